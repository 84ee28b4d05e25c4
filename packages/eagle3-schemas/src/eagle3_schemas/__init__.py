"""eagle3-schemas: the contract between the EAGLE-3 pipeline stages.

Stages never import each other; they share this library and files on disk. It loads the
versioned schema files under ``schemas/``, writes artifacts atomically with their header and
lineage, and validates any artifact, naming every violation with its location.
"""

from eagle3_schemas.artifact import Violation
from eagle3_schemas.atomic import atomic_directory, atomic_path, write_json_atomic
from eagle3_schemas.header import ArtifactError, Header, read_header
from eagle3_schemas.lineage import (
    fingerprint_artifact,
    fingerprint_file,
    fingerprint_json,
    fingerprint_model_dir,
    fingerprint_tokenizer_dir,
    fingerprint_vocab_map,
    lineage_mismatches,
)
from eagle3_schemas.paths import PathArgumentError
from eagle3_schemas.validate import detect_kind, validate

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
