"""The policy worker: hosts a user's ``policy.py`` and streams action chunks to robots over gRPC.

Layout (one concept per module):

- :mod:`.server`: :func:`create_server` / :func:`serve_policy_file` -> :class:`WorkerServer` (port, stop,
  health service, token interceptor, TLS, keepalive, housekeeping thread).
- :mod:`.config`: :class:`ServerConfig`, every worker setting once (its defaults are ``seq serve``'s).
- :mod:`.servicer`: the thin ``PolicyService`` servicer.  :mod:`.episode_call`: one Episode call
  (:class:`EpisodeCallHandler`).
- :mod:`.runtime`: one deployment (warming, episodes, inference, usage), made of the parts in
  :mod:`.deployment_state` (readiness, restart budget, load plan, running episodes, end counts).
  :mod:`.hosting`: the one interface it calls its policy through (:class:`~.hosting.PolicyHost`: in the
  worker, or in a deployment process).  :mod:`.scheduler`: its single inference thread with per-episode
  round-robin, batching requests of different episodes when the policy declares ``seq.Batching``.
- :mod:`.registry` and :mod:`.validate`: ``seq deploy`` (dry run) and the $SEQ_HOME registry.
- :mod:`.policy_process` and :mod:`.policy_host`: the deployment process (``--isolation process``, the default): each
  deployment's policy code runs in its own process, restarted when it crashes or hangs.
- :mod:`.usage`: metering.  :mod:`.capture_hook`: the bridge to :mod:`sequence_ai_ros.capture.store`.

Its ``seq`` sub-commands live in :mod:`sequence_ai_ros.cli.serving`; the models that templates import
in :mod:`sequence_ai_ros.models`.

Threads, all named and owned: ``seq-grpc-loop`` (gRPC asyncio: every call and open stream is a coroutine),
``seq-io`` (its fixed executor for blocking work), ``seq-capture`` (capture writes), ``seq-decode`` (JPEG/PNG
frames), ``seq-load-<name>`` (warming), ``seq-infer-<name>`` (inference, batches and episode hooks),
``seq-housekeeping`` (usage flush, capture retention), and when asked ``seq-agent`` (HAProxy readiness) and the
metrics endpoint.
:meth:`WorkerServer.stop` stops them all.
:mod:`.fleet` starts N worker processes behind HAProxy (``seq fleet``); :mod:`.metrics` and
:mod:`.health_agent` serve operators and the balancer.
"""

from __future__ import annotations

from typing import Any

__all__ = ['WorkerServer', 'create_server', 'serve_policy_file']


def __getattr__(name: str) -> Any:
    # Lazy: `seq --help` and the templates must not pay for grpc at import.
    if name in __all__:
        from sequence_ai_ros.worker import server

        return getattr(server, name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
