#!/usr/bin/env bash
# Make (once) the cached LeRobot venv of `make check-lerobot` and print its path on the last line.
#   ensure_venv.sh PYTHON REQUIREMENTS CACHE_DIR
# The venv lives outside the clone, in CACHE_DIR/lerobot-<first 16 hex of sha256(REQUIREMENTS)>, so a second
# clone (or CI after a session) with the same requirements reuses it. It is stamped only when complete (a killed
# build is redone from scratch next time); flock serialises two clones.
set -euo pipefail
py=$1 req=$2 cache=$3
key=$(sha256sum "$req" | cut -c1-16)
venv="$cache/lerobot-$key"
mkdir -p "$cache"
exec 9>"$cache/.lerobot-$key.lock"
flock 9
if [ ! -f "$venv/.stamp" ]; then
  rm -rf "$venv"
  echo "check-lerobot: building $venv from $req with $("$py" --version) (torch is several GB: minutes)" >&2
  # venv scripts hard-code their folder: build in place under the final name, stamp when complete
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r "$req" >&2
  cp "$req" "$venv/requirements.txt"
  touch "$venv/.stamp"
fi
echo "$venv"
