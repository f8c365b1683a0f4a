#!/usr/bin/env bash
# Make (once) the stand-in for a sourced ROS 2 Jazzy distro that `make test-jazzy` uses, and print its path on the
# last line (source PATH/setup.bash, as a robot sources /opt/ros/jazzy/setup.bash).
#   ensure_distro.sh PYTHON CACHE_DIR ROS2_TOOLS
# PYTHON: a CPython 3.12 (Jazzy's); ROS2_TOOLS: the folder holding jazzy/ (the ros2cli/launch wheels, checked against
# jazzy/MANIFEST.txt) and src/composition_interfaces.
#
# Layout, like an Ubuntu 24.04 robot with ROS 2 Jazzy installed:
#   usr/            the system Python: PYTHON's standard library (linked, not copied) and its own site-packages with
#                   what apt installs as python3-* (numpy 1.26.4, PyYAML, Pillow, colcon, catkin_pkg, ...). A venv
#                   made from usr/bin/python3 with --system-site-packages sees them below its own packages.
#   opt/ros/jazzy/  the ROS prefix: the ros-* wheels, the ros2cli/launch wheels and composition_interfaces (built here
#                   with colcon); on PYTHONPATH, AMENT_PREFIX_PATH and LD_LIBRARY_PATH once setup.bash is sourced.
#   setup.bash      what /opt/ros/jazzy/setup.bash does for a shell.
# It lives outside the clone, in CACHE_DIR/jazzy-<key>, keyed by what made it: test/jazzy/distro-requirements.txt,
# requirements-ros2-tools.txt, this script, the wheels' sha256s in MANIFEST.txt, composition_interfaces' source
# and the interpreter (version and installation). It is built in a temporary folder and renamed into place when
# complete, so an interrupted build is never used; flock serialises two clones.
set -euo pipefail
py=$1 cache=$2 tools=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
req=$here/distro-requirements.txt
tools_req=$repo/requirements-ros2-tools.txt
wheels=$tools/jazzy
src=$tools/src/composition_interfaces
say() { echo "test-jazzy: $*" >&2; }

# The wheels must be the ones MANIFEST.txt names, byte for byte, and no others.
manifest_sums=$(grep -v '^#' "$wheels/MANIFEST.txt" | awk 'NF {print $NF "  " $1}')
(cd "$wheels" && sha256sum --quiet -c <<<"$manifest_sums") >&2 ||
  { say "the wheels in $wheels do not match its MANIFEST.txt"; exit 2; }
for whl in "$wheels"/*.whl; do
  grep -q "^$(basename "$whl") " "$wheels/MANIFEST.txt" || { say "$whl is not in MANIFEST.txt"; exit 2; }
done

interp=$("$py" -c 'import os, sys; print(sys.version.split()[0], os.path.realpath(sys.base_prefix))')
key=$({ sha256sum "$req" "$tools_req" "${BASH_SOURCE[0]}" | cut -d' ' -f1
        echo "$manifest_sums"
        (cd "$src" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
        echo "$interp"; } | sha256sum | cut -c1-16)
final=$cache/jazzy-$key
mkdir -p "$cache"
exec 9>"$cache/.jazzy-$key.lock"
flock 9
if [ -f "$final/setup.bash" ]; then echo "$final"; exit 0; fi

start=$(date +%s)
tmp=$cache/.jazzy-$key.tmp
rm -rf "$tmp"
say "building the Jazzy stand-in $final (Python $interp, $(grep -c '^[A-Za-z]' "$req") pinned wheels; a few minutes)"
sys=$tmp/usr ros=$tmp/opt/ros/jazzy
base=${interp#* }
pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

# The system Python: PYTHON's executable copied (so that its prefix is usr/), its standard library linked, an empty
# site-packages of its own, and pip from ensurepip (Ubuntu's python3-pip).
mkdir -p "$sys/bin" "$sys/lib/python$pyver/site-packages"
cp "$(realpath "$py")" "$sys/bin/python$pyver"
ln -s "python$pyver" "$sys/bin/python3"
ln -s python3 "$sys/bin/python"
ln -s "$base/include" "$sys/include"
for entry in "$base/lib/python$pyver"/*; do
  case ${entry##*/} in site-packages|dist-packages|test) ;; *) ln -s "$entry" "$sys/lib/python$pyver/${entry##*/}" ;; esac
done
spy=$sys/bin/python3
site=$("$spy" -c 'import sys, sysconfig; assert sys.prefix == sys.base_prefix; print(sysconfig.get_paths()["purelib"])')
case $site in "$sys"/*) ;; *) say "$py does not take its prefix from its location ($site)"; exit 2 ;; esac
"$spy" -m ensurepip >/dev/null 2>&1 || { say "$py has no ensurepip: it cannot make venvs"; exit 2; }
pip=("$spy" -m pip install -q --no-deps --no-compile --root-user-action=ignore --disable-pip-version-check)

# The system packages (every line of the pinned list but ros-*), then the ROS prefix.
sysreq=$tmp/system-requirements.txt rosreq=$tmp/ros-requirements.txt
grep -v '^ros-' "$req" > "$sysreq"
grep '^ros-' "$req" > "$rosreq"
"${pip[@]}" -r "$sysreq" -r "$tools_req" >&2
"${pip[@]}" --prefix "$ros" -r "$rosreq" >&2
"${pip[@]}" --prefix "$ros" --no-index "$wheels"/*.whl >&2
rossite=$ros/lib/python$pyver/site-packages
test -d "$rossite/rclpy" || { say "rclpy did not land in $rossite"; exit 2; }

# The wheels' CMake exports name their build host's Python and numpy include folders (/opt/python/cp312-cp312/...,
# numpy/core/include on numpy 1.x): pointed at this Python's and the system numpy's.
inc=$("$spy" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
np=$("$spy" -c 'import numpy; print(numpy.get_include())')
{ grep -rl "/opt/python/cp${pyver/./}-cp${pyver/./}/" "$ros/share" --include='*.cmake' || true; } | xargs -r sed -i \
  -e "s|/opt/python/cp${pyver/./}-cp${pyver/./}/lib/python$pyver/site-packages/numpy/_\?core/include|$np|g" \
  -e "s|/opt/python/cp${pyver/./}-cp${pyver/./}/include/python$pyver|$inc|g"

# setup.bash: what /opt/ros/jazzy/setup.bash does for a shell, from wherever the stand-in lies.
cat > "$tmp/setup.bash" <<EOF
# The Jazzy stand-in's setup.bash (test/jazzy/ensure_distro.sh): what /opt/ros/jazzy/setup.bash does for a bash
# shell. The system Python is usr/bin/python3 (make venvs from it); usr/bin comes last on PATH, as /usr/bin would.
_seq_jazzy=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
_seq_ros=\$_seq_jazzy/opt/ros/jazzy
export ROS_DISTRO=jazzy ROS_VERSION=2 ROS_PYTHON_VERSION=3
export AMENT_PREFIX_PATH="\$_seq_ros\${AMENT_PREFIX_PATH:+:\$AMENT_PREFIX_PATH}"
export CMAKE_PREFIX_PATH="\$_seq_ros\${CMAKE_PREFIX_PATH:+:\$CMAKE_PREFIX_PATH}"
export PYTHONPATH="\$_seq_ros/lib/python$pyver/site-packages\${PYTHONPATH:+:\$PYTHONPATH}"
# the wheels' shared libraries: lib/ and the ros_*.libs folders auditwheel vendored (what their bootstrapper .pth
# adds when it re-executes Python; a .pth on PYTHONPATH is never run)
_seq_ld=\$_seq_ros/lib
for _seq_libs in "\$_seq_ros/lib/python$pyver/site-packages"/ros_*.libs; do
  [ -d "\$_seq_libs" ] && _seq_ld=\$_seq_ld:\$_seq_libs
done
export LD_LIBRARY_PATH="\$_seq_ld\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export PATH="\$_seq_ros/bin\${PATH:+:\$PATH}:\$_seq_jazzy/usr/bin"
unset _seq_jazzy _seq_ros _seq_ld _seq_libs
EOF

# composition_interfaces (launch_ros imports it) from source, into the ROS prefix, as the distro builds it (the
# build folder beside, not inside: the libraries keep its source paths in their assertion strings).
colcon=$tmp.colcon
rm -rf "$colcon"
say "composition_interfaces with colcon ($(( $(date +%s) - start )) s so far)"
(
  set +u; source "$tmp/setup.bash"; set -u
  cd "$tmp"
  "$spy" -m colcon --log-base "$colcon/log" build --base-paths "$src" --build-base "$colcon/build" \
    --install-base "$ros" --merge-install --event-handlers console_direct- \
    --cmake-args -DBUILD_TESTING=OFF -DPython3_EXECUTABLE="$spy" >&2
  "$spy" -c 'import composition_interfaces.srv, rclpy, launch_ros, ros2cli' >&2
)
rm -rf "$colcon" "$sysreq" "$rosreq"

# Into place: the paths written during the build (script shebangs, the CMake rewrite, colcon's files) name the
# temporary folder; they are rewritten to the final one, the Python modules compiled for it, and nothing may still
# name the temporary folder.
grep -rlI --null -F "$tmp" "$tmp" | xargs -0 -r sed -i "s|$tmp|$final|g"
find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
"$spy" -m compileall -q -j 0 -s "$tmp" -p "$final" "$site" "$rossite" >/dev/null
left=$(grep -rl -F "$tmp/" "$tmp" | head -5 || true)
[ -z "$left" ] || { say "files still name the build folder: $left"; exit 2; }
rm -rf "$final"
mv "$tmp" "$final"
say "Jazzy stand-in ready in $(( $(date +%s) - start )) s: $final"
echo "$final"
