"""Datasets: LeRobot read and write, stats, video, and JSONL, for exports of captured field data.

- :mod:`.lerobot_reader`: reads LeRobot v2.1 datasets (pyarrow, PyAV).
- :mod:`.lerobot_writer`: writes a capture store as LeRobot v2.1 (parquet via pyarrow, mp4 via
  :mod:`.video`, stats via :mod:`.stats`).  :mod:`.jsonl_writer`: the JSONL export.
- :mod:`.export_common`: episode selection and frame decoding shared by the writers.
- :mod:`.verify`: re-reads an export and checks its schema against a reference dataset.

Imports: protocol, capture (to read a store) and exceptions; never the worker or the node.
Threads: a LeRobot export decodes JPEG frames in a named pool (``export-decode``) joined before it
returns. pyarrow and PyAV are imported lazily, with an install hint when missing.
"""
