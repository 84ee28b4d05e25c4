"""transformers backend: forward hooks on the decoder layers, in vLLM's layer-id convention.

Id ``k >= 1`` is the output of decoder layer ``k-1`` (the residual stream after k layers); id 0
is the input of decoder layer 0 (the embedding output, after any embedding scaling the model
applies). Id ``N`` is therefore the last layer's output *before* the final norm, which
``output_hidden_states[N]`` is not (transformers applies the norm before appending it).

Only the base model runs (``AutoModel``): no LM head is loaded or computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagle3_extract.plan import ShardPlan, bytes_per_token
from eagle3_extract.progress import CaptureProgress, capture_progress
from eagle3_extract.samples import Sample
from eagle3_extract.target import read_target, transformers_refusal
from eagle3_extract.writer import CapturedSample, CaptureError, check_room, write_shard

if TYPE_CHECKING:
    from eagle3_extract.context import RunContext
    from eagle3_extract.workdir import WorkDir

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_base_model(
    model_dir: Path, dtype: torch.dtype, trust_remote_code: bool = False
) -> nn.Module:
    """The target's decoder stack (no LM head), for plain and multimodal-wrapper checkpoints.

    A wrapper (Kimi-K2.5: ``text_config``, weights under ``language_model.model.``) is loaded
    as transformers' own wrapper class, whose checkpoint conversion knows the hub layout, and
    its ``language_model`` is returned; the vision tower is built without layers (extraction
    never runs it). Quantized checkpoints (Kimi's INT4 routed experts) are refused before a
    byte of weights is read.
    """
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    refusal = transformers_refusal(read_target(model_dir))
    if refusal:
        raise CaptureError(refusal)
    config = AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    wrapper = hasattr(config, "text_config")
    if wrapper and hasattr(getattr(config, "vision_config", None), "num_hidden_layers"):
        config.vision_config.num_hidden_layers = 0
    # Loading the base model from a *ForCausalLM checkpoint reports lm_head.weight as
    # "UNEXPECTED": by design here (no LM head is computed), so keep that report quiet.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModel.from_pretrained(
            model_dir,
            config=config,
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or [])
    if wrapper:
        model = model.language_model
        missing = [k for k in missing if k.startswith("language_model.")]
    if missing:
        raise CaptureError(
            f"{model_dir}: {len(missing)} decoder weight(s) are not in the checkpoint "
            f"(e.g. {missing[:3]}); they would be random"
        )
    model.eval()
    return model


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and final norm of a base model, checked rather than assumed."""
    layers = getattr(model, "layers", None)
    norm = getattr(model, "norm", None)
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise CaptureError(
            f"{type(model).__name__}: expected attributes 'layers' (ModuleList) and 'norm' on the "
            "base model (Llama/Qwen/DeepSeek layout); this architecture needs its own hook map"
        )
    return layers, norm


def _first_tensor(value: Any) -> torch.Tensor:
    # Decoder layers return a tensor in transformers 5, a tuple (hidden, ...) in 4.x.
    tensor = value[0] if isinstance(value, tuple) else value
    if not isinstance(tensor, torch.Tensor):
        raise CaptureError(f"decoder layer returned {type(value).__name__}, expected a tensor")
    return tensor


class LayerCapture:
    """Context manager: hooks that record the residual stream at the given vLLM layer ids."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        self.layers, _ = decoder_parts(model)
        n = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= i <= n]
        if bad:
            raise CaptureError(f"layer ids {bad} outside [0, {n}] for a {n}-layer model")
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> LayerCapture:
        for layer_id in sorted(set(self.layer_ids)):
            if layer_id == 0:

                def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
                    hidden = args[0] if args else kwargs["hidden_states"]
                    self.captured[0] = hidden.detach()

                self._handles.append(
                    self.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
                )
            else:

                def hook(_m: nn.Module, _args: Any, output: Any, layer_id: int = layer_id) -> None:
                    self.captured[layer_id] = _first_tensor(output).detach()

                self._handles.append(self.layers[layer_id - 1].register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take(self) -> list[torch.Tensor]:
        """The captured tensors in ``layer_ids`` order; raises if a hook did not fire."""
        missing = [i for i in self.layer_ids if i not in self.captured]
        if missing:
            raise CaptureError(f"hooks for layer ids {missing} did not fire during the forward")
        out = [self.captured[i] for i in self.layer_ids]
        self.captured = {}
        return out


def batches(samples: Sequence[Sample], batch_tokens: int) -> Iterator[list[Sample]]:
    """Length-sorted batches whose padded size (longest x count) fits ``batch_tokens``."""
    ordered = sorted(samples, key=lambda s: -s.num_tokens)
    batch: list[Sample] = []
    for sample in ordered:
        if batch and batch[0].num_tokens * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(sample)
    if batch:
        yield batch


class HFBackend:
    """Reference capture with transformers; float32 on CPU by default."""

    name = "hf"

    def __init__(
        self,
        model_dir: Path,
        layer_ids: Sequence[int],
        *,
        dtype: str = "float32",
        batch_tokens: int = 8192,
        model: nn.Module | None = None,
        trust_remote_code: bool = False,
        device: str = "cpu",
    ) -> None:
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.model = (
            model
            if model is not None
            else load_base_model(model_dir, self.dtype, trust_remote_code)
        ).to(self.device)
        self.layers, self.norm = decoder_parts(self.model)
        self.layer_ids = list(layer_ids)
        self.batch_tokens = batch_tokens

    @torch.inference_mode()
    def forward_states(self, batch: Sequence[Sample]) -> list[torch.Tensor]:
        """``[T_i, n_ids, H]`` float32 states of each sample of ``batch`` (right-padded)."""
        longest = max(s.num_tokens for s in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, sample in enumerate(batch):
            ids[row, : sample.num_tokens] = torch.from_numpy(sample.input_ids.astype("int64"))
            mask[row, : sample.num_tokens] = 1
        with LayerCapture(self.model, self.layer_ids) as capture:
            self.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
            )
            stacked = torch.stack(capture.take(), dim=2).to("cpu", torch.float32)  # [B, L, n, H]
        return [stacked[row, : s.num_tokens].clone() for row, s in enumerate(batch)]

    def capture(
        self, samples: Sequence[Sample], progress: CaptureProgress | None = None
    ) -> list[CapturedSample]:
        """States of ``samples``, returned in the order given; ``progress`` counts each batch."""
        by_id: dict[str, torch.Tensor] = {}
        for batch in batches(samples, self.batch_tokens):
            for sample, states in zip(batch, self.forward_states(batch), strict=True):
                by_id[sample.sample_id] = states
            if progress is not None:
                progress.advance(len(batch), sum(s.num_tokens for s in batch))
        return [CapturedSample(s, by_id[s.sample_id]) for s in samples]

    @torch.inference_mode()
    def self_check(self, sample: Sample) -> list[str]:
        """Dry run on one sample: the hooks see what the model computes, and id N is pre-norm.

        Checks (a) applying the model's own final norm to captured id N reproduces the model's
        output, and (b) captured ids < N equal ``output_hidden_states``. Returns problems found.
        """
        n = len(self.layers)
        ids = torch.from_numpy(sample.input_ids.astype("int64"))[None].to(self.device)
        with LayerCapture(self.model, sorted({*self.layer_ids, n})) as capture:
            out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            got = dict(zip(capture.layer_ids, capture.take(), strict=True))
        problems = []
        renormed = self.norm(got[n])
        # equal_nan: a sample with NaN states is rejected by the writer, not a failed check.
        if not torch.allclose(
            renormed, out.last_hidden_state, rtol=1e-4, atol=1e-5, equal_nan=True
        ):
            problems.append(
                "final norm applied to the captured id N does not give the model's output: the "
                "hook on the last decoder layer does not see the pre-norm residual stream"
            )
        hidden_states = out.hidden_states
        if hidden_states is None or len(hidden_states) != n + 1:
            problems.append(
                f"output_hidden_states returned {0 if hidden_states is None else len(hidden_states)}"
                f" tensors, expected {n + 1} (embeddings + one per layer)"
            )
        else:
            for layer_id, tensor in got.items():
                same = torch.allclose(tensor, hidden_states[layer_id], 0, 0, equal_nan=True)
                if layer_id < n and not same:
                    problems.append(
                        f"captured id {layer_id} differs from output_hidden_states[{layer_id}]"
                    )
        return problems


def run_shards_hf(
    ctx: RunContext,
    work: WorkDir,
    pending: Sequence[ShardPlan],
    backend: HFBackend | None = None,
) -> int:
    """Capture and write every pending shard; returns the tokens processed."""
    config = ctx.config
    if backend is None:
        backend = HFBackend(
            config.model,
            ctx.layer_ids,
            dtype=ctx.compute_dtype,
            batch_tokens=config.batch_tokens,
            trust_remote_code=config.trust_remote_code,
            device=config.device,
        )
    if backend.layer_ids != ctx.layer_ids:
        raise CaptureError(
            f"backend captures ids {backend.layer_ids}, the run needs {ctx.layer_ids}"
        )
    if config.preflight:
        problems = backend.self_check(pending[0].samples[0])
        if problems:
            raise CaptureError("transformers dry run failed: " + "; ".join(problems))
        log.info("preflight [ok] transformers dry run: hooks see the pre-norm residual stream")
    tokens = 0
    started = time.perf_counter()
    samples = sum(len(p.samples) for p in pending)
    with capture_progress(samples, sum(p.num_tokens for p in pending)) as bar:
        per_token = bytes_per_token(
            len(ctx.aux_layer_ids), ctx.target.hidden_size, config.storage_dtype
        )
        for number, plan in enumerate(pending, 1):
            ctx.make_room([plan])
            check_room(work.root, [plan], per_token)  # a full disk stops before the capture
            fragment = write_shard(
                work.root,
                work.fragments_dir,
                plan,
                backend.capture(plan.samples, bar),
                n_aux=len(ctx.aux_layer_ids),
                hidden_size=ctx.target.hidden_size,
                storage_dtype=config.storage_dtype,
            )
            tokens += plan.num_tokens
            elapsed = time.perf_counter() - started
            log.info(
                "shard %s written (%d/%d, %d samples, %d rejected, %.0f tokens/s)",
                plan.name,
                number,
                len(pending),
                len(fragment.rows),
                len(fragment.rejected),
                tokens / max(elapsed, 1e-9),
            )
            if ctx.should_stop() and number < len(pending):  # sealed; the rest on rerun
                break
    return tokens
