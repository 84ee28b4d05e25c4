"""Bytes to disk and back, knowing nothing of any schema: atomic writes (``atomic``), JSON lines
cut short by a kill (``jsonl``), the safetensors format read without a tensor framework
(``safetensors_format``), a full disk as a named stop (``diskspace``), and the hashing primitives
lineage builds on (``fingerprint``: canonical JSON, ``sha256:`` of files).

The bottom room: imports nothing else of this library.
"""
