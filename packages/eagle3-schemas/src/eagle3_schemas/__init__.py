"""eagle3-schemas: the contract between the EAGLE-3 pipeline stages.

Stages never import each other; they share this library and files on disk. It loads the
versioned schema files under ``schemas/``, writes artifacts atomically with their header and
lineage, and validates any artifact, naming every violation with its location.

Four rooms, each importing only the rooms below it (import-linter holds this):

- ``contract``: the schema files, headers, validation and the named checks, lineage, path
  arguments, the streaming hand-off;
- ``layouts``: what each shared file looks like (conversations, hidden states, the draft
  checkpoint, the target's config and custom code);
- ``io``: atomic writes, JSON lines, the safetensors format, free disk space, fingerprints;
- ``runtime``: preemption signals, the CUDA driver check, a child's failure, command-line options.

``cli`` is the ``eagle3-schemas`` command; ``moved`` keeps the pre-room import paths
(``eagle3_schemas.atomic``, ...) working for one release, with a DeprecationWarning.
"""

import sys

from eagle3_schemas import moved
from eagle3_schemas.contract.artifact import Violation
from eagle3_schemas.contract.header import ArtifactError, Header, read_header
from eagle3_schemas.contract.lineage import (
    fingerprint_artifact,
    fingerprint_file,
    fingerprint_json,
    fingerprint_model_dir,
    fingerprint_tokenizer_dir,
    fingerprint_vocab_map,
    lineage_mismatches,
)
from eagle3_schemas.contract.paths import PathArgumentError
from eagle3_schemas.contract.validate import detect_kind, validate
from eagle3_schemas.io.atomic import atomic_directory, atomic_path, write_json_atomic

moved.install(sys.modules[__name__])

__all__ = [
    "ArtifactError",
    "Header",
    "PathArgumentError",
    "Violation",
    "atomic_directory",
    "atomic_path",
    "detect_kind",
    "fingerprint_artifact",
    "fingerprint_file",
    "fingerprint_json",
    "fingerprint_model_dir",
    "fingerprint_tokenizer_dir",
    "fingerprint_vocab_map",
    "lineage_mismatches",
    "read_header",
    "validate",
    "write_json_atomic",
]
