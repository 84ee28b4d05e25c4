"""train.recompute: activation checkpointing of each decoder layer per TTT step.

Without it a step keeps, per token, every layer's inputs to backward for every TTT step (the
MLP's gate/up/product, q/k/v, the norms' inputs); with it only the layer's input and the
keys/values the later TTT steps read, and backward runs the layer's forward again
(torch.utils.checkpoint, non-reentrant).

The layer is not a pure function of its arguments: ``ttt_attend`` appends this step's keys to
the layer's ``LayerCache`` and attends over what the cache holds. When backward recomputes
step k, the live cache holds the keys of every step, and a second append would grow it. So
the first run writes the live cache (later steps read it), and every recomputation runs on a
replay of the cache as it stood before step k: the same step-0 tensors and the first n
diagonal entries (the cache only ever appends). The recomputed forward is then the same
computation on the same tensors as the first one.
"""

from __future__ import annotations

from torch import Tensor, is_grad_enabled, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from eagle3_train.model.layers import LayerCache
from eagle3_train.model.shift import Alignment


class _CacheBefore:
    """A layer cache as it stood before one TTT step's append."""

    def __init__(self, cache: LayerCache) -> None:
        self.cache = cache
        self.started = cache.k0 is not None
        self.entries = len(cache.kd)

    def replay(self) -> LayerCache:
        replay = LayerCache()
        if self.started:
            replay.k0, replay.v0 = self.cache.k0, self.cache.v0
            replay.kd = self.cache.kd[: self.entries]
            replay.vd = self.cache.vd[: self.entries]
        return replay


def run_layer(
    layer: nn.Module,
    weights: dict[str, Tensor],
    x: Tensor,
    embeds: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    cache: LayerCache,
    docs: Alignment,
) -> Tensor:
    """One decoder layer at one TTT step, its parameters named in ``weights`` replaced by
    those tensors (``draft.cast_once``); recomputed in backward when ``layer.recompute``."""

    def call(
        x: Tensor, embeds: Tensor | None, cos: Tensor, sin: Tensor, cache: LayerCache
    ) -> Tensor:
        if not weights:
            return layer(x, embeds, cos, sin, cache, docs)
        return functional_call(layer, weights, (x, embeds, cos, sin, cache, docs))

    if not (layer.recompute and is_grad_enabled()):
        return call(x, embeds, cos, sin, cache)
    before = _CacheBefore(cache)
    runs = 0

    def forward(x: Tensor, embeds: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor:
        nonlocal runs
        runs += 1
        return call(x, embeds, cos, sin, cache if runs == 1 else before.replay())

    return checkpoint(forward, x, embeds, cos, sin, use_reentrant=False)
