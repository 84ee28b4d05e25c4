"""Whether a draft checkpoint stores its vocabulary map, by the rule the serving engines load.

vLLM's EAGLE-3 drafts (``llama_eagle3.py`` and ``deepseek_eagle3.py``, 0.32 and 0.33) create
``draft_id_to_target_id``, the parameter a checkpoint's ``d2t`` is loaded into, only when the
draft's ``draft_vocab_size`` differs from the target's ``vocab_size``. So:

- a **full-vocabulary** draft (V_draft = V_target) that holds ``d2t`` stops the engine at load
  (``There is no module or parameter named 'draft_id_to_target_id'``);
- a **pruned** draft (V_draft < V_target) without ``d2t`` loads, and its ``draft_id_to_target_id``
  stays zeros: draft id i silently becomes target id i.

SGLang's ``llama_eagle3.py`` turns a ``d2t`` into ``hot_token_id`` and needs none when the
vocabularies are equal. Both engines skip ``t2d``. The rule every writer follows: ``d2t`` and
``t2d`` are stored exactly when V_draft < V_target; without them the map is the identity
(``d2t`` zeros, ``t2d`` all true), and its fingerprint is that identity's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

VOCAB_MAP_TENSORS = ("d2t", "t2d")
# The classes that hold draft_id_to_target_id only for a pruned vocabulary.
VLLM_DRAFT_CLASSES = "vLLM's Eagle3LlamaForCausalLM / Eagle3DeepseekV2ForCausalLM"


def stores_vocab_map(draft_vocab_size: int, target_vocab_size: int) -> bool:
    """Whether a checkpoint of these sizes holds ``d2t`` and ``t2d``."""
    return int(draft_vocab_size) != int(target_vocab_size)


def identity_vocab_map(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The map of a full-vocabulary draft: ``d2t`` zeros (offsets), ``t2d`` all true."""
    return np.zeros(int(vocab_size), dtype=np.int64), np.ones(int(vocab_size), dtype=np.bool_)


def serving_problems(
    tensor_names: Collection[str], draft_vocab_size: int, target_vocab_size: int
) -> list[tuple[str, str]]:
    """``(tensor, why)`` for each reason vLLM would not serve a draft whose weight file holds
    ``tensor_names``, as far as the vocabulary map goes; empty when it would."""
    full = not stores_vocab_map(draft_vocab_size, target_vocab_size)
    sizes = f"draft_vocab_size {draft_vocab_size}, target vocab_size {target_vocab_size}"
    if full and "d2t" in tensor_names:
        return [
            (
                "d2t",
                f"{VLLM_DRAFT_CLASSES} create draft_id_to_target_id only when the draft "
                f"vocabulary differs from the target's ({sizes}), so vLLM refuses to load this "
                "draft; a full vocabulary's map is the identity: store no d2t and no t2d",
            )
        ]
    if not full and "d2t" not in tensor_names:
        return [
            (
                "d2t",
                f"missing for a pruned vocabulary ({sizes}); {VLLM_DRAFT_CLASSES} would keep "
                "draft_id_to_target_id at zeros and map draft id i onto target id i",
            )
        ]
    return []


def checkpoint_vocab_map(
    tensor_names: Collection[str],
    read: Callable[[str], np.ndarray],
    draft_vocab_size: int,
    target_vocab_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The draft's ``(d2t, t2d)``: the stored tensors (``read(name)``), or the identity of a
    full vocabulary that stores none. A ``t2d`` that is absent beside a stored ``d2t`` is
    rebuilt from it (servers ignore ``t2d``)."""
    if "d2t" not in tensor_names:
        if stores_vocab_map(draft_vocab_size, target_vocab_size):
            raise KeyError(
                f"d2t: a draft of {draft_vocab_size} tokens over a target of {target_vocab_size} "
                "stores no d2t; which target token each draft id stands for cannot be told"
            )
        return identity_vocab_map(target_vocab_size)
    d2t = np.asarray(read("d2t"), dtype=np.int64)
    if "t2d" in tensor_names:
        return d2t, np.asarray(read("t2d"), dtype=np.bool_)
    t2d = np.zeros(int(target_vocab_size), dtype=np.bool_)
    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t
    t2d[target_ids[(target_ids >= 0) & (target_ids < len(t2d))]] = True
    return d2t, t2d
