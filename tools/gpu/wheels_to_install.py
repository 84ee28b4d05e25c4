"""Which carried wheels to install on the device machine: those whose distribution the image
lacks (its own — typing-extensions, idna, … that torch and transformers were installed with —
are never overridden). Prints their paths; on stderr, each wheel kept out and each
requirement of an installed wheel that the image's version does not meet (an import that then
fails has its reason in the log).

    python3 tools/gpu/wheels_to_install.py .whl/*.whl
"""

from __future__ import annotations

import email
import importlib.metadata
import sys
import zipfile
from pathlib import Path


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(name)).get_all("Requires-Dist", [])


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` in this Python; None where it has none."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(wheels: list[Path]) -> int:
    installed: dict[str, str] = {}
    for wheel in wheels:
        name, carried = wheel.name.split("-")[:2]
        if (have := installed_version(name)) is None:
            installed[name] = carried
            print(wheel)
        else:
            print(f"kept the image's {name} {have} (carried {carried})", file=sys.stderr)
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:  # no check without packaging; the imports will tell
        return 0
    carried_versions = {canonicalize_name(n): v for n, v in installed.items()}
    for wheel in wheels:
        name = wheel.name.split("-")[0]
        if name not in installed:
            continue
        for text in _requirements(wheel):
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dist = canonicalize_name(req.name)
            version = carried_versions.get(dist) or installed_version(req.name)
            if version is None or not req.specifier.contains(version, prereleases=True):
                print(f"unmet: {name} needs {text}; here: {version or 'absent'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main([Path(a) for a in sys.argv[1:]]))
