"""A target's config.json as every stage reads it: the language model's fields, wherever they sit.

Multimodal wrappers (Kimi-K2.5, Llama-4, Qwen-VL) nest the decoder's config under
``text_config``; reading ``hidden_size`` or ``vocab_size`` from the top level of such a file finds
nothing, and a check that skips a missing field passes silently. Every stage reads through here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields of a parsed config.json (the file itself for plain models)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def read_text_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    return text_config(json.loads(path.read_text(encoding="utf-8")))
