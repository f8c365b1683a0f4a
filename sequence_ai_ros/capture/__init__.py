"""The worker-side field-data store: what robots saw and did, kept per deployment to fine-tune on.

- :mod:`.store`: ``CaptureStore`` (one per deployment, ``$SEQ_HOME/capture/<name>``, see
  :mod:`sequence_ai_ros.home`): sampling, labels, retention, usage, fault pauses.
- :mod:`.episode`: one episode, staged then committed by one atomic rename.
- :mod:`.index`: the SQLite (WAL) index.  :mod:`.recovery`: crash recovery of staged episodes.
- :mod:`.settings`: ``settings.json`` and the sampling rule.  :mod:`.records`: the episode record file
  (length-prefixed protobuf records).

Imports: protocol and exceptions only; never the worker, the client or the node (the worker calls in
through :mod:`sequence_ai_ros.worker.capture_hook`). Exports read stores through :mod:`sequence_ai_ros.datasets`.
Threads: none; the worker's threads call a store under the store's own lock.
"""
