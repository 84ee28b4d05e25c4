"""The schema files checked against the meta-schema and the named checks, and frozen on release.

A released schema version is frozen: ``schemas/FROZEN.json`` holds the sha256 of every
released file and editing one fails the meta-check. A change means a new version file
(``v2.json``) plus a reader for the old one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jsonschema

from eagle3_schemas.contract.checks import CHECKS
from eagle3_schemas.contract.registry import META, SCHEMA_DIR

FROZEN_FILE = "FROZEN.json"


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def meta_check(schema_dir: Path = SCHEMA_DIR) -> list[str]:
    """Every problem with the schema files themselves; empty when all is well."""
    problems: list[str] = []
    # The newest meta-schema: a later one admits what new schema versions need (conversations
    # v2's message type) and still admits every released file.
    newest_meta = max((schema_dir / META).glob("v*.json"), key=lambda p: int(p.stem[1:]))
    meta = json.loads(newest_meta.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(meta)
    validator = jsonschema.Draft202012Validator(meta)
    files = sorted(p for p in schema_dir.glob("*/v*.json") if p.parent.name != META)
    for path in files:
        rel = path.relative_to(schema_dir).as_posix()
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            problems.append(f"{rel}: not valid JSON ({e})")
            continue
        for err in validator.iter_errors(schema):
            where = "/".join(str(p) for p in err.absolute_path) or "(top)"
            problems.append(f"{rel}: {where}: {err.message}")
        if (
            schema.get("artifact") != path.parent.name
            or f"v{schema.get('version')}.json" != path.name
        ):
            problems.append(
                f"{rel}: artifact/version {schema.get('artifact')!r}/v{schema.get('version')} do not match the path"
            )
        symbols = set(schema.get("symbols", {}))
        for role, spec in schema.get("files", {}).items():
            for tname, tspec in spec.get("tensors", {}).items():
                for dim in tspec.get("shape", []):
                    if isinstance(dim, str) and dim not in symbols:
                        problems.append(
                            f"{rel}: files/{role}/tensors/{tname}: shape symbol {dim!r} is not declared in 'symbols'"
                        )
            if "json_schema" in spec:
                try:
                    jsonschema.Draft202012Validator.check_schema(spec["json_schema"])
                except jsonschema.SchemaError as e:
                    problems.append(f"{rel}: files/{role}/json_schema: {e.message}")
        try:
            jsonschema.Draft202012Validator.check_schema(schema.get("header", {}).get("fields", {}))
        except jsonschema.SchemaError as e:
            problems.append(f"{rel}: header/fields: {e.message}")
        implemented = CHECKS.get(schema.get("artifact"), {})
        for name in schema.get("checks", {}):
            if name not in implemented:
                problems.append(
                    f"{rel}: check {name!r} has no implementation in eagle3_schemas.contract.checks"
                )
        # A check may arrive with a later version (readers run what a file's version declares);
        # the newest version declares every implemented check.
        newest = max(
            (p for p in files if p.parent.name == path.parent.name), key=lambda p: int(p.stem[1:])
        )
        for name in implemented if path == newest else ():
            if name not in schema.get("checks", {}):
                problems.append(
                    f"{rel}: eagle3_schemas.contract.checks implements {name!r}, which the schema does not declare"
                )
    problems += _frozen_problems(schema_dir, files)
    return problems


def _frozen_problems(schema_dir: Path, files: list[Path]) -> list[str]:
    lock_path = schema_dir / FROZEN_FILE
    if not lock_path.is_file():
        return [
            f"{FROZEN_FILE}: missing; run `eagle3-schemas freeze` once the schema files are released"
        ]
    frozen: dict[str, str] = json.loads(lock_path.read_text(encoding="utf-8"))
    problems = []
    all_files = [*files, *sorted((schema_dir / META).glob("v*.json"))]
    for path in all_files:
        rel = path.relative_to(schema_dir).as_posix()
        if rel not in frozen:
            problems.append(f"{rel}: not frozen; release it with `eagle3-schemas freeze`")
        elif frozen[rel] != _sha256(path):
            problems.append(
                f"{rel}: released schema was edited (hash {_sha256(path)[:19]}… != frozen {frozen[rel][:19]}…); "
                "released versions are immutable: add the next version file and a reader for this one"
            )
    for rel in frozen:
        if not (schema_dir / rel).is_file():
            problems.append(f"{rel}: frozen schema file was deleted")
    return problems


def freeze(schema_dir: Path = SCHEMA_DIR) -> list[str]:
    """Add every not-yet-frozen schema file to the lock; never rewrites an existing entry."""
    lock_path = schema_dir / FROZEN_FILE
    frozen: dict[str, str] = (
        json.loads(lock_path.read_text(encoding="utf-8")) if lock_path.is_file() else {}
    )
    added = []
    for path in sorted(schema_dir.glob("*/v*.json")):
        rel = path.relative_to(schema_dir).as_posix()
        if rel not in frozen:
            frozen[rel] = _sha256(path)
            added.append(rel)
    lock_path.write_text(json.dumps(frozen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return added
