"""The recipes' own Python, for the tests: ``recipes/recipe_targets.py``, and what the tests read
of a recipe beyond it: its flags.sh arrays, EAGLE-3's aux-layer rule.

The recipes' pipelines run that file as a script and recipes/ is not a package, so it is
imported here by path, once, under its own name.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from support.scripts import load_script

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _load(name: str) -> ModuleType:
    return load_script(RECIPES / f"{name}.py")


recipe_targets = _load("recipe_targets")


def eagle3_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers in vLLM's convention (id k = residual after k layers):
    low, middle and high, ``[2, N//2, N-3]``. Distinct and inside [1, N-1] only for N >= 7."""
    if num_layers < 7:
        raise recipe_targets.RecipeError(
            f"[2, N//2, N-3] needs N >= 7 decoder layers, found N = {num_layers}"
        )
    return [2, num_layers // 2, num_layers - 3]


def stage_flags(
    recipe_dir: Path, knobs: dict[str, str], names: Sequence[str]
) -> dict[str, list[str]]:
    """The arrays (or scalars) ``names`` of the recipe's flags.sh, as bash expands them with
    ``knobs`` set and no other knob inherited from the caller's environment."""
    script = (
        'set -euo pipefail; source "$1"; shift; '
        'for name in "$@"; do declare -n ref="$name"; printf "@%s\\0" "$name"; '
        'for x in "${ref[@]}"; do printf "%s\\0" "$x"; done; unset -n ref; done'
    )
    done = subprocess.run(
        ["bash", "-c", script, "flags", str(Path(recipe_dir) / "flags.sh"), *names],
        cwd=RECIPES.parent,
        env={"PATH": "/usr/bin:/bin", **knobs},
        capture_output=True,
        text=True,
        check=True,
    )
    # NUL-separated words; "@NAME" opens an array (flags may hold spaces, never NULs).
    arrays: dict[str, list[str]] = {}
    current: list[str] = []
    for item in done.stdout.split("\0")[:-1]:
        if item.startswith("@") and item[1:] in names:
            current = arrays.setdefault(item[1:], [])
        else:
            current.append(item)
    return arrays
