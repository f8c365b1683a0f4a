"""The ROS 2 policy node: camera and joint topics in, fixed-rate commands out, episodes as services.

A thin adapter over the ROS-free client engine (:mod:`sequence_ai_ros.client`), which holds every
piece of chunk logic (buffer, prefetch, resampling to the control period, delta integration, seams).
Run it with a robot's params file and the deployment to drive, e.g. from the repository root
``ros2 run sequence_ai_ros policy_node --ros-args --params-file config/g1.yaml -p model:=my_policy``
(``-p autostart:=true`` makes it configure and activate itself; the ``policy_node`` console script takes the
same arguments where ros2cli is absent). ``config/policy_node.yaml`` lists every parameter at its default: a
template, which names no ``model`` and no ``joints.names``, so the node refuses it alone (exit 2).

Modules, one concept each:

- :mod:`.parameter_schema` (reads ``policy_node_parameters.yaml``, the one declaration of every parameter in
  generate_parameter_library's field names), :mod:`.config` (validated dataclasses, defaults from the
  schema) and :mod:`.parameters` (the ROS declarations with descriptors, and the on-set checks);
- :mod:`.images` (Image/CompressedImage -> arrays or untouched JPEG, no cv_bridge),
  :mod:`.observation` (latest message per source, ages, joint mapping by name);
- :mod:`.runner` (one episode at a time; hold semantics; each episode owns its tick counts),
  :mod:`.worker_link` (the connection to the worker, and what the runner uses of the client's Policy),
  :mod:`.controller_commands` (ros2_control command interfaces), :mod:`.safety` (limits, step limits,
  non-finite values);
- :mod:`.command_output` (one output per ``command.mode``, picked once: streaming, or trajectory), and
  :mod:`.trajectory` (trajectory mode: a chunk's horizon as one JointTrajectory);
- :mod:`.tick` (the control thread of each activation), :mod:`.diagnostics` (~/status, /diagnostics, the
  WARN/ERROR levels);
- :mod:`.policy_node` (the lifecycle node), :mod:`.episode_services` (its services and Act action),
  :mod:`.executors` (two executors split by callback group), :mod:`.main` (entry point, autostart).

Threads and their owners:

- main thread (:func:`.main.main`): a SingleThreadedExecutor serving the observation group (joint and
  camera callbacks, which convert each message once) and the reporting group (~/status, /diagnostics);
- ``seq-services`` (owned by :func:`.main.main`): a MultiThreadedExecutor serving the node's other groups:
  services and the Act action (reentrant: they block on gRPC or on an episode's end) and the lifecycle
  services (their own group, so a blocking configure stalls nothing). Both executors serve the one
  lifecycle node, split by callback group (:mod:`.executors`);
- ``seq-autostart`` (owned by :func:`.main.main`, with ``autostart``): configures (retrying every second)
  and activates the node;
- ``seq-tick`` (owned by :class:`.policy_node.PolicyNode`'s :class:`.tick.ControlThreads` while active): the
  fixed-rate control thread.
  It reads the latest observation, calls the client's non-blocking ``next_action`` and publishes; it
  never waits on gRPC, and takes no lock that is held across I/O. Deadlines come from the client's
  :class:`~sequence_ai_ros.client.pacing.Pacer`;
- ``seq-session`` (owned by :class:`.policy_node.PolicyNode`'s :class:`.runner.SessionThread` while
  configured): the blocking gRPC calls:
  reconnects (every second), ``ready()`` (polled every second), ``end_episode``;
- per episode, the client's ``seq-recv-*`` thread and gRPC's request thread (owned by the client).

Executor choice, measured on this 2-core machine (50 Hz tick, two 640x480 rgb8 cameras at 30 Hz from
another process, camera callbacks doing about 5 ms of work; p99 of |dt - 20 ms|):
rclpy timer on the SingleThreadedExecutor that also serves the cameras 7.9 ms (it waits behind
callbacks; 0.4 ms with empty callbacks); EventsExecutor 17 ms; MultiThreadedExecutor 106 ms and only
38 Hz; a dedicated thread on absolute deadlines 3.7 ms at 50.00 Hz (GIL-bound, so the node lowers the
switch interval to 1 ms). The node uses the dedicated thread. The services, the Act action and the
lifecycle services live on the node itself (issue 15), yet a MultiThreadedExecutor serving the
observations cost 51 % of a core against 14 % (joint_states at 100 Hz) and, under load, 34 Hz with a
214 ms p99 in make demo; so two executors split the node by callback group. ``bench_node`` measures
the whole node (commands stamped in the node,
and at a subscriber); test_node_replay guards the command rate under the same camera load.

Stale sources (documented behaviour, tested): a source older than its ``max_age_s`` (local receive
time) makes the observation invalid; the node then sends no request, holds, and names the source in
/diagnostics and ~/status. When the source comes back within ``stale_grace_s`` the episode resumes
where the client's timeline is (the safety step limit bounds the first command); when it stays away
longer, the episode ends with reason 'error' and a message naming the source.
"""
