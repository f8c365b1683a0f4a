"""``make demo``: the whole system, robot side and policy side, on real recorded robot data.

:mod:`.pipeline` runs the steps through the same commands a user types; :mod:`.processes` owns the
child processes (own process groups, always stopped); :mod:`.ros_side` is the operator node (Act goal,
label, command watcher); :mod:`.synthetic` is the robot stand-in when no dataset is present;
:mod:`.summary` prints the figures.
"""
