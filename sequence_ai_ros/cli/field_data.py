"""``seq`` sub-commands of field data: ``policy capture``, ``policy data export``, ``data to-rosbag``.

Thin: each parses, calls the module that does the work, and prints a short report. The store of a
deployment is ``$SEQ_HOME/capture/<name>`` (``$SEQ_HOME`` as the worker's registry resolves it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import Any

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.home import capture_root, seq_home


def _check_registered(name: str) -> None:
    """Refuse a deployment name the worker registry does not know.

    :raises UnknownDeployment: naming the registered deployments and ``--force``.
    """
    from sequence_ai_ros.exceptions import UnknownDeployment
    from sequence_ai_ros.worker.registry import Registry

    try:
        Registry(seq_home()).get(name)
    except UnknownDeployment as exc:
        raise UnknownDeployment(f'{exc}; pass --force to set capture for {name!r} anyway') from None


def _store(name: str, stores: list[Path] | None = None, read_only: bool = True) -> Any:
    """The store of deployment ``name``; the name is checked like a deployment name (never a path).

    :param stores: capture store directories of the deployment's replicas (``--store``), read as one
        (:class:`~sequence_ai_ros.capture.store_set.StoreSet`); None: ``$SEQ_HOME/capture/<name>``.
    :param read_only: open the store as a reader (exports, stats, plots: nothing is written to it).
    :raises ConfigError: for a name that is not a valid deployment name (e.g. ``../x``), even with --force,
        or a ``--store`` that is not a capture store.
    """
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.worker.registry import check_name

    check_name(name)
    if stores and read_only:
        from sequence_ai_ros.capture.store_set import StoreSet

        return StoreSet(stores, name)
    if stores:
        if len(stores) != 1:
            raise ConfigError('give one --store DIR here (the store to set, show or repair)')
        root = Path(stores[0]).expanduser().resolve()
        if not ((root / 'store.db').is_file() or (root / 'episodes').is_dir()):
            raise ConfigError(f'{root} is not a capture store (no store.db, no episodes/); a store is '
                              f'$SEQ_HOME/capture/<deployment> of a worker')
        return CaptureStore(root, deployment=name)
    return CaptureStore(capture_root(seq_home(), name), deployment=name, read_only=read_only)


def _add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--store', action='append', type=Path, default=None, metavar='DIR',
                        help='read this capture store of NAME instead of $SEQ_HOME/capture/NAME; repeat it to '
                             'read the stores of several replicas (e.g. one per pod) as one')


def parse_when(text: str) -> float:
    """Parse ``--since``/``--until``: seconds since the epoch, or an ISO 8601 date/time (local time if naive).

    :raises ConfigError: for anything else.
    """
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError(f'cannot read time {text!r}: give seconds since the epoch or an ISO 8601 date '
                          f'such as 2026-11-29 or 2026-11-29T08:00') from None


def _subgroup(sub: argparse._SubParsersAction, groups: dict[str, argparse._SubParsersAction], name: str,
              help_text: str) -> argparse._SubParsersAction:
    if name not in groups:
        parser = sub.add_parser(name, help=help_text)
        groups[name] = parser.add_subparsers(dest=f'{name}_command', metavar='COMMAND', required=True)
    return groups[name]


def add_parsers(sub: argparse._SubParsersAction, groups: dict[str, argparse._SubParsersAction]) -> None:
    """Register ``policy capture``, ``policy data export`` and ``data to-rosbag``."""
    policy = _subgroup(sub, groups, 'policy', 'a deployment\'s field data: capture and export')
    cap = policy.add_parser('capture', help='set or show what a deployment keeps of its episodes')
    cap.add_argument('name', help='deployment name')
    cap.add_argument('--rate', type=float, help='share of episodes kept, in [0, 1] (turns capture on)')
    cap.add_argument('--images', action=argparse.BooleanOptionalAction, default=None,
                     help='keep camera frames (default: off, no pixels stored)')
    cap.add_argument('--retention-days', type=float, help='delete episodes older than this (default 30)')
    cap.add_argument('--fps', type=_fps_setting, help='row rate of captured episodes, Hz, or "policy" '
                     '(the default: the policy\'s 1/dt)')
    cap.add_argument('--quota-bytes', type=int, help='pause capture when the store holds this many bytes')
    cap.add_argument('--off', action='store_true', help='stop new capture; what was kept stays for its retention')
    cap.add_argument('--repair', action='store_true', help='rebuild a corrupted index from the episode files')
    cap.add_argument('--store', action='append', type=Path, default=None, metavar='DIR',
                     help='act on this capture store of NAME (e.g. a replica\'s) instead of $SEQ_HOME/capture/NAME')
    cap.add_argument('--json', action='store_true', help='print the summary as JSON')
    cap.add_argument('--force', action='store_true',
                     help='act on NAME even when it is not a registered deployment (e.g. served by file)')
    cap.set_defaults(func=cmd_capture)

    data = policy.add_parser('data', help='export captured episodes')
    data_sub = data.add_subparsers(dest='data_command', metavar='COMMAND', required=True)
    exp = data_sub.add_parser('export', help='write captured episodes as a LeRobot v2.1 dataset or JSON Lines')
    exp.add_argument('name', help='deployment name')
    exp.add_argument('--out', required=True, type=Path, help='output directory (must be empty, or --force)')
    exp.add_argument('--format', choices=('lerobot', 'jsonl'), default='lerobot')
    exp.add_argument('--since', type=parse_when, help='episodes started at or after (epoch s or ISO date)')
    exp.add_argument('--until', type=parse_when, help='episodes started before (epoch s or ISO date)')
    exp.add_argument('--labelled-only', action='store_true', help='only labelled episodes')
    exp.add_argument('--images', action=argparse.BooleanOptionalAction, default=None,
                     help='include camera frames (videos for lerobot); default: whenever they were captured')
    exp.add_argument('--lerobot-version', choices=('2.1', '3.0'), default='2.1',
                     help='LeRobot dataset version: 2.1 (LeRobot <= 0.3) or 3.0 (LeRobot >= 0.4)')
    exp.add_argument('--fps', type=float, default=None, help='rows per second (default: the policy\'s 1/dt)')
    exp.add_argument('--strict', action='store_true', help='fail (exit 2, nothing written) when any episode '
                     'would be skipped')
    exp.add_argument('--vcodec', choices=('av1', 'h264'), default='av1',
                     help='video codec: av1 (libsvtav1, LeRobot\'s default) or h264 (libx264 ultrafast)')
    exp.add_argument('--force', action='store_true', help='replace an earlier export of ours at --out (a folder '
                     'our export did not write, or holding files it did not write, is refused)')
    exp.add_argument('--robot-type', default=None, help='info.json robot_type (lerobot)')
    _add_store_option(exp)
    exp.set_defaults(func=cmd_export)

    plot = data_sub.add_parser('plot', help='picture of one captured episode: chunks, commands, state, seams')
    plot.add_argument('name', help='deployment name')
    plot.add_argument('--episode', required=True, help='episode id')
    plot.add_argument('--out', required=True, type=Path, help='PNG file to write')
    _add_store_option(plot)
    plot.set_defaults(func=cmd_plot)

    st = policy.add_parser('stats', help='the deployment\'s scoreboard per version and day',
                           description='Per deployment version and day: episodes, the success rate of the labelled '
                                       'ones, underruns, "p95 ms" (the 95th percentile over the episodes of each '
                                       'one\'s chunk round-trip p95, ms) and how the episodes ended.')
    st.add_argument('name', help='deployment name')
    st.add_argument('--plot', type=Path, default=None, help='also draw it into this PNG')
    st.add_argument('--json', action='store_true', help='print the rows as JSON')
    _add_store_option(st)
    st.set_defaults(func=cmd_stats)

    tools = _subgroup(sub, groups, 'data', 'dataset tools')
    bag = tools.add_parser('to-rosbag', help='write a LeRobot v2.1 episode as a rosbag2 (mcap)')
    bag.add_argument('dataset', type=Path, help='LeRobot v2.1 dataset directory')
    bag.add_argument('--episode', type=int, required=True, help='episode_index')
    bag.add_argument('--out', type=Path, required=True, help='bag directory to create')
    bag.add_argument('--joint-topic', default='/joint_states', help='sensor_msgs/JointState topic')
    bag.add_argument('--camera-topic', action='append', default=None, metavar='KEY=TOPIC',
                     help='camera topic (CompressedImage) per key, e.g. cam_high=/cam_high/image_raw/compressed; '
                          'default: /<key>/image_raw/compressed for every camera')
    bag.add_argument('--no-cameras', action='store_true', help='joints only')
    bag.add_argument('--distro', default='humble', help='typestore of the message definitions (default humble)')
    bag.set_defaults(func=cmd_to_rosbag)


def _fps_setting(text: str) -> float | str:
    return 'policy' if text == 'policy' else float(text)


def _fmt_time(t: float | None) -> str:
    return '-' if t is None else dt.datetime.fromtimestamp(t).strftime('%Y-%m-%d %H:%M:%S')


def _fmt_bytes(n: float) -> str:
    for unit in ('B', 'kB', 'MB', 'GB'):
        if n < 1000 or unit == 'GB':
            return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
        n /= 1000
    return str(n)


def cmd_capture(args: argparse.Namespace) -> int:
    """Update the capture settings when options are given, then print what the store keeps.

    :raises UnknownDeployment: when NAME is not a registered deployment and ``--force`` is not given
        (a typo would otherwise create a store no worker ever reads).
    """
    from sequence_ai_ros.capture.settings import load_settings, save_settings

    store = _store(args.name, getattr(args, 'store', None), read_only=False)   # checks the name, --force or not
    if not getattr(args, 'force', False) and not getattr(args, 'store', None):
        _check_registered(args.name)
    changes: dict[str, Any] = {}
    if args.rate is not None:
        changes.update(rate=args.rate, enabled=True)
    if args.images is not None:
        changes['images'] = args.images
    if args.retention_days is not None:
        changes['retention_days'] = args.retention_days
    if args.fps is not None:
        changes['fps'] = None if args.fps == 'policy' else args.fps
    if args.quota_bytes is not None:
        changes['quota_bytes'] = args.quota_bytes
    if args.off:
        changes['enabled'] = False
    if changes:
        settings = dataclasses.replace(load_settings(store.root), **changes)
        save_settings(store.root, settings)
    if args.repair:
        print(f'capture {args.name}: index rebuilt, {store.repair()} episodes')
    s = store.summary()
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    st, status = s['settings'], s['status']
    state = status['state'] + (f' ({status["diagnostic"]})' if status['diagnostic'] else '')
    quota = 'none' if st['quota_bytes'] is None else _fmt_bytes(st['quota_bytes'])
    print(f'capture {args.name}: {state}')
    fps = 'policy rate (1/dt)' if st['fps'] is None else f'{st["fps"]:g}'
    print(f'  settings: rate {st["rate"]:g}, images {"on" if st["images"] else "off"}, fps {fps}, '
          f'retention {st["retention_days"]:g} days, quota {quota}, {"enabled" if st["enabled"] else "off"}')
    print(f'  kept: {s["episodes"]} episodes ({s["labelled"]} labelled, {s["unlabelled"]} unlabelled), '
          f'{s["frames"]} frames, {s["requests"]} requests, {_fmt_bytes(s["bytes_on_disk"])} on disk')
    print(f'  oldest {_fmt_time(s["oldest"])}, newest {_fmt_time(s["newest"])}')
    print(f'  store: {s["root"]}')
    return 0


#: Exit status of an export that wrote every good episode but skipped some (listed on stdout).
EXIT_SKIPPED = 3


def cmd_export(args: argparse.Namespace) -> int:
    """Export a deployment's captured episodes.

    :returns: 0 when every chosen episode was written; :data:`EXIT_SKIPPED` when some were skipped (each
        listed with its reason); with ``--strict`` a skip fails the export (ExportError, exit 2, nothing
        written).
    """
    from sequence_ai_ros.exceptions import ExportError

    store = _store(args.name, args.store)
    common = dict(since=args.since, until=args.until, labelled_only=args.labelled_only, force=args.force)
    if args.format == 'lerobot':
        from sequence_ai_ros.datasets.lerobot_writer import export_lerobot

        out = args.out
        if args.strict:   # export into a scratch directory first; nothing reaches --out if anything is skipped
            import shutil
            import tempfile

            scratch = Path(tempfile.mkdtemp(prefix='.seq-strict-', dir=Path(args.out).expanduser().parent))
            out = scratch / 'export'
        res = export_lerobot(store, out, vcodec=args.vcodec, robot_type=args.robot_type, images=args.images,
                             fps=args.fps, lerobot_version=args.lerobot_version, **common)
        if args.strict:
            bad = [(str(root), why) for root, why in getattr(store, 'skipped_stores', [])]
            if res['skipped'] or bad:
                shutil.rmtree(scratch, ignore_errors=True)
                raise ExportError('--strict: ' + '; '.join(
                    [f'store {root} would be skipped: {why}' for root, why in bad] +
                    [f'{eid} would be skipped: {why}' for eid, why in res['skipped']]))
            from sequence_ai_ros.datasets.export_common import check_out, finish

            finish(Path(res['out']), check_out(args.out, args.force))
            shutil.rmtree(scratch, ignore_errors=True)
            res['out'] = str(args.out)
        what = (f'LeRobot v{res["version"]}, {res["episodes"]} episodes, {res["frames"]} frames at {res["fps"]} fps, '
                f'{res["videos"]} videos')
    else:
        from sequence_ai_ros.datasets.jsonl_writer import export_jsonl

        res = export_jsonl(store, args.out, images=bool(args.images), **common)
        what = f'{res["episodes"]} episodes, {res["requests"]} requests, {res["frames"]} telemetry frames'
    print(f'exported {args.name} ({args.format}) to {res["out"]}: {what}')
    for note in res.get('notes', []):
        print(f'  note: {note}')
    for episode_id, where in getattr(store, 'duplicates', []):
        print(f'  note: episode {episode_id} is also in {where}; the copy with more frames was exported')
    for root, why in getattr(store, 'skipped_stores', []):
        print(f'  skipped store {root}: {why}')
    for episode_id, why in res['skipped']:
        print(f'  skipped {episode_id}: {why}')
    if getattr(store, 'skipped_stores', []) and not res['skipped']:
        print(f'  {len(store.skipped_stores)} stores skipped (exit status {EXIT_SKIPPED}; --strict makes this a '
              f'failure)')
        return EXIT_SKIPPED
    if res['skipped']:
        print(f'  {len(res["skipped"])} episodes skipped (exit status {EXIT_SKIPPED}; --strict makes this a failure)')
        return EXIT_SKIPPED
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw one captured episode into a PNG."""
    from sequence_ai_ros.datasets.scoreboard import plot_episode

    out = plot_episode(_store(args.name, args.store), args.episode, args.out)
    print(f'wrote {out}')
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """Print the deployment's scoreboard per version and day (and draw it with --plot)."""
    from sequence_ai_ros.datasets.scoreboard import plot_scoreboard, scoreboard
    from sequence_ai_ros.protocol.limits import MAX_REASON, printable

    rows = scoreboard(_store(args.name, args.store).runs())
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f'policy {args.name}: no episodes recorded yet')
    else:
        print(f'policy {args.name}: {sum(r["episodes"] for r in rows)} episodes')
        print(f'  {"version":>7} {"day":10} {"episodes":>8} {"success":>14} {"underruns":>9} {"p95 ms":>7}  ended')
        for r in rows:
            rate = '-' if r['success_rate'] is None else f'{100 * r["success_rate"]:.0f}% of {r["labelled"]}'
            lat = '-' if r['latency_p95_ms'] is None else f'{r["latency_p95_ms"]:.1f}'
            ended = ', '.join(f'{printable(k)[:MAX_REASON]} {v}' for k, v in sorted(r['ended'].items()))
            print(f'  {r["version"]:>7} {r["day"]:10} {r["episodes"]:>8} {rate:>14} {r["underruns"]:>9} {lat:>7}  '
                  f'{ended}')
    if args.plot is not None:
        print(f'wrote {plot_scoreboard(rows, args.plot, f"policy {args.name}")}')
    return 0


def cmd_to_rosbag(args: argparse.Namespace) -> int:
    """Convert one LeRobot episode to a rosbag2 (mcap)."""
    from sequence_ai_ros.bags.to_rosbag import episode_to_rosbag

    cameras: dict[str, str] | None = None
    if args.no_cameras:
        cameras = {}
    elif args.camera_topic:
        cameras = {}
        for item in args.camera_topic:
            key, sep, topic = item.partition('=')
            if not sep or not key or not topic:
                raise ConfigError(f'--camera-topic {item!r}: expected KEY=TOPIC')
            cameras[key] = topic
    res = episode_to_rosbag(args.dataset, args.episode, args.out, joint_topic=args.joint_topic,
                            camera_topics=cameras, distro=args.distro)
    counts = ', '.join(f'{t}: {n}' for t, n in res['counts'].items())
    print(f'wrote {res["out"]} ({res["duration_s"]:.2f} s; {counts})')
    return 0
