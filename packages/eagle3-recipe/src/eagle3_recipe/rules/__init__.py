"""The decisions of a recipe, one small function each, every one returning its value with its
reason: a rule measured in this repository (cited by file and section) or the arithmetic shown.

Rules that are not measured say so. Two anchors carry the measured lr rules:
- GPU: the 8B recipes' settings at hidden 4096 and 65,536 tokens per step (EAGLE-3's AdamW lr,
  Muon's from the tiny sweep by width; docs/benchmarks/lr-width.md);
- CPU: the tiny recipes' settings, measured at hidden 256 and 2,048 tokens per step.

One module per concern: ``draft``, ``regeneration``, ``training``, ``extraction``, ``storage``,
``hours``; ``base`` holds what they share.
"""

from __future__ import annotations

from eagle3_recipe.rules.base import Decision
from eagle3_recipe.rules.draft import aux_layer_ids, draft_layer, draft_shape, draft_vocab
from eagle3_recipe.rules.extraction import Layout, extraction_layout
from eagle3_recipe.rules.hours import hours
from eagle3_recipe.rules.regeneration import Regeneration, expected_tokens, regeneration, samples
from eagle3_recipe.rules.storage import Storage, storage
from eagle3_recipe.rules.training import (
    ACCELERATE_CONFIG,
    ZERO2_ABOVE,
    activation_bytes_per_token,
    check_fits,
    gradient_accumulation,
    largest_fit,
    learning_rates,
    max_length,
    schedule,
    tokens_per_batch,
    training_state_bytes,
    zero_stage,
)

__all__ = [
    "ACCELERATE_CONFIG",
    "ZERO2_ABOVE",
    "Decision",
    "Layout",
    "Regeneration",
    "Storage",
    "activation_bytes_per_token",
    "aux_layer_ids",
    "check_fits",
    "draft_layer",
    "draft_shape",
    "draft_vocab",
    "expected_tokens",
    "extraction_layout",
    "gradient_accumulation",
    "hours",
    "largest_fit",
    "learning_rates",
    "max_length",
    "regeneration",
    "samples",
    "schedule",
    "storage",
    "tokens_per_batch",
    "training_state_bytes",
    "zero_stage",
]
