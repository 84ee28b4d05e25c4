"""The FLOPs and bytes of one training step at the GPU recipes' draft shapes: counted, not timed.

Ours' step (the trainer's model, loss, objective and optimizer; data.batch.forward with its
pinned host batch and non-blocking copies) runs on fake ``cuda:0`` tensors
(tests/support/fake_cuda.py: shapes and dtypes, no storage, no GPU), and every op is counted:
GEMM FLOPs by torch's own formulas, the flash kernel's on its document-causal pairs, and the
bytes each op would move run eagerly (it reads its inputs and writes its outputs once, a
gather only the rows it picks; a view moves nothing). Eager bytes are an upper bound on the
element-wise parts: under ``train.compile`` Inductor fuses them (its backward graphs cannot be
lowered without a GPU). Autocast runs without its cache of weight casts, as inside the compiled
layers the GPU recipes run, which that cache does not reach.

Each step runs three ways:
- ``recipes``: what a user's step runs (train: defaults' objective, Muon + AdamW as the GPU
  recipes set them, the LM head trained, every token scored);
- ``recipes, before``: the same before the LM head's weight gradient became one GEMM per TTT
  step (a float32 [V, H] accumulation after every 1,024-row loss chunk) and before the layers'
  weights were cast once per step (each TTT call cast them again, and their float32 gradients
  were summed);
- ``bench``: the settings of the H200 rows in gpu-throughput.md (plain TTT KL, AdamW, the head
  frozen, 3/4 of each document scored; weights cast per TTT call, as they ran), the anchor of
  the prediction.

The prediction (``predict``): each op at the H200's peak (989 TFLOP/s dense bf16, 4.8 TB/s),
whichever bound it meets, summed; scaled by what the H200 measured for the ``bench`` row
against its own count; set against speculators 0.9.0 at its defaults (Muon), its measured
``bench`` step plus its Newton–Schulz. A prediction, not a measurement: tools/gpu/gpu_check.py
measures.

    uv run --frozen python tools/gpu/step_counts.py                # all shapes, a table
    uv run --frozen python tools/gpu/step_counts.py --json docs/benchmarks/step-counts.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tools" / "bench")]  # the fake device; the bench

PEAK_FLOPS = 989e12  # H200 (and H100 SXM) dense bf16
PEAK_BYTES = 4.8e12  # H200 HBM3e
# (hidden, heads, intermediate, V_target, V_draft, document lengths), as gpu_check's CUDA rows
SHAPES = {
    "llama": (4096, 32, 14336, 128256, 32000, (2048,) * 4),
    "kimi": (7168, 64, 18432, 163840, 32000, (2048,) * 4),
    "long": (4096, 32, 14336, 128256, 32000, (32768,)),
}
# the H200's measured bench rows (gpu-throughput.json, tokens/s): ours, speculators
MEASURED = {"llama": (76657, 66976), "kimi": (34030, 32125), "long": (47984, 49510)}
PCIE_BYTES = 55e9  # host→device over PCIe Gen5 x16, as measured on H100/H200 hosts
VARIANTS = {  # objective, optimizer, head, scored share, the head dW after every chunk,
    # the layers' weights cast at every TTT call
    "bench": ("plain", "adamw", "frozen", 0.75, False, True),
    "recipes, before": ("defaults", "muon", "trained", 1.0, True, True),
    "recipes": ("defaults", "muon", "trained", 1.0, False, False),
}
PARTS = (
    "attention",
    "GEMM, LM heads",
    "GEMM, layers",
    "element-wise and reductions",
    "host→device copies",
    "optimizer, Newton–Schulz GEMMs",
    "optimizer, element-wise",
)
RANKS = 8  # the recipes' GPUs: Muon's orthogonalisation shared among them


def draft_arch(shape: str):
    """The draft of ``shape`` as the bench builds it (one Llama-style layer), flash attention."""
    from train_step_sides import ours_arch

    hidden, heads, intermediate, v_target, v_draft, _ = SHAPES[shape]
    fields = dict(hidden=hidden, heads=heads, intermediate=intermediate, attention="flash")
    return ours_arch(argparse.Namespace(**fields, v_target=v_target, v_draft=v_draft))


def count_step(shape: str, variant: str) -> dict[str, dict[str, float]]:
    """{part: {"flops", "bytes", "peak_ms"}} of one step of ours on the fake device."""
    import torch
    from train_step_sides import _objective, _optimizer

    from eagle3_train.config.run_config import Config
    from eagle3_train.data import batch as batch_module
    from eagle3_train.model import draft as draft_module
    from eagle3_train.model import loss as loss_module

    from support import fake_cuda as fc
    from support import fake_step

    hidden, _, _, v_target, v_draft, lengths = SHAPES[shape]
    objective, optimizer_name, head, scored, per_chunk, cast_per_call = VARIANTS[variant]
    arch = draft_arch(shape)
    config = Config()
    t = config.train
    t.ttt_steps, t.compile = fake_step.TTT, "never"
    t.objective, t.ttt_step_loss_decay, t.max_grad_norm = _objective(objective)
    accelerator = fake_step.Accelerator(autocast_cache=False)  # as in compiled layers
    rows, cast_once = loss_module.HEAD_GRAD_ROWS_ELEMENTS, draft_module.cast_once
    batch_module.align, align = fake_step.real_align, batch_module.align
    loss_module.HEAD_GRAD_ROWS_ELEMENTS = 1 if per_chunk else rows
    if cast_per_call:  # autocast then casts each weight inside each TTT call
        draft_module.cast_once = lambda layer, dtype: {}
    try:
        with fc.fake_cuda() as mode:
            model = fake_step.make_model(arch, config, accelerator)
            target_head = torch.randn(v_target, hidden, device=fc.DEVICE)
            model.load_target_head(
                target_head, torch.ones(hidden, device=fc.DEVICE), target_head[:v_draft]
            )
            if head == "frozen":
                model.lm_head.weight.requires_grad_(False)
            optimizer = _optimizer(optimizer_name, model, model.trainable_parameters(), fused=True)
            _, _, record = fake_step.train_step(
                mode,
                model,
                config,
                accelerator,
                optimizer,
                lengths=lengths,
                scored=scored,
                count=True,
            )
    finally:
        batch_module.align, loss_module.HEAD_GRAD_ROWS_ELEMENTS = align, rows
        draft_module.cast_once = cast_once
    return by_part(record, (v_target, v_draft))


def by_part(record, vocab: tuple[int, int]) -> dict[str, dict[str, float]]:
    parts: dict[str, Counter] = {p: Counter() for p in PARTS}
    for key, moved in record.bytes.items():
        phase, op, dims = key
        flops = record.flops.get(key, 0)
        if phase == "optimizer":
            part = "optimizer, Newton–Schulz GEMMs" if flops else "optimizer, element-wise"
        elif dims == ("h2d",):
            part = "host→device copies"
        elif "flash" in op:
            part = "attention"
        elif flops:
            part = "GEMM, LM heads" if set(vocab) & set(dims) else "GEMM, layers"
        else:
            part = "element-wise and reductions"
        parts[part]["flops"] += flops
        parts[part]["bytes"] += moved
        # each op at whichever peak bounds it (ops of one key share their shapes)
        bandwidth = PCIE_BYTES if part == "host→device copies" else PEAK_BYTES
        parts[part]["peak_ms"] += 1e3 * max(flops / PEAK_FLOPS, moved / bandwidth)
    return {p: dict(c) for p, c in parts.items()}


def totals(parts: dict[str, dict[str, float]]) -> dict[str, float]:
    return {k: sum(p.get(k, 0) for p in parts.values()) for k in ("flops", "bytes", "peak_ms")}


def critical_ms(parts: dict[str, dict[str, float]], copies: bool, ranks: int) -> float:
    """The step's time at peak on one GPU's compute stream: host→device copies count where
    they run on it (``copies``), Newton–Schulz is each rank's share of the matrices."""
    ms = {p: c.get("peak_ms", 0) for p, c in parts.items()}
    ms["host→device copies"] *= copies
    ms["optimizer, Newton–Schulz GEMMs"] /= ranks
    return sum(ms.values())


PREDICTED = (  # label, counted variant, copies on the compute stream, ours' NS share, GPUs
    ("bench's settings (the batch staged once); both measured", "bench", False, 1, 1),
    ("recipes' settings, before: head dW per chunk, weights cast per TTT call, copies on "
     "the compute stream, Newton–Schulz whole on every rank", "recipes, before", True, 1, RANKS),
    ("recipes' settings, now", "recipes", False, 1, 1),
    ("recipes' settings, now: Newton–Schulz shared", "recipes", False, RANKS, RANKS),
)  # fmt: skip


def predict(counted: dict[str, dict[str, dict[str, dict[str, float]]]]) -> list[list]:
    """Per shape: ours' step and speculators' in ms, per GPU, and their ratio. The bench row is
    measured on both sides; the others scale ours' count at peak by measured / counted of the
    bench row. speculators at its 0.9.0 defaults runs Muon on the same matrices as ours: its
    measured AdamW step plus their Newton–Schulz at the same scale, shared among the GPUs as
    its FSDP2 shards them (torch's Muon on DTensors; the collectives are not counted)."""
    rows = []
    for shape, variants in counted.items():
        tokens = sum(SHAPES[shape][5])
        ours_bench, theirs_bench = (1e3 * tokens / rate for rate in MEASURED[shape])
        scale = ours_bench / critical_ms(variants["bench"], False, 1)
        newton_schulz = variants["recipes"]["optimizer, Newton–Schulz GEMMs"]["peak_ms"] * scale
        for label, variant, copies, share, gpus in PREDICTED:
            ours = critical_ms(variants[variant], copies, share) * scale
            theirs = theirs_bench + (variant != "bench") * newton_schulz / gpus
            rows.append(
                [shape, label, gpus, round(ours, 1), round(theirs, 1), round(theirs / ours, 3)]
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of: " + ", ".join(SHAPES))
    parser.add_argument("--json", type=Path, help="write the result file here")
    args = parser.parse_args(argv)
    counted = {
        shape: {variant: count_step(shape, variant) for variant in VARIANTS}
        for shape in args.shapes.split(",")
    }
    grid = [
        [shape, variant, part, round(c.get("flops", 0) / 1e12, 2), round(c.get("bytes", 0) / 1e9, 1),
         round(c.get("peak_ms", 0), 2)]
        for shape, variants in counted.items()
        for variant, parts in variants.items()
        for part, c in [*parts.items(), ("total", totals(parts))]
    ]  # fmt: skip
    for row in grid:
        print("  ".join(f"{x:>12}" if not isinstance(x, str) else f"{x:<28}" for x in row))
    predicted = predict(counted) if set(counted) <= set(MEASURED) else []
    for row in predicted:
        print(
            f"predicted: {row[0]:<6} {row[2]} GPU  {row[3]:>7} ms  {row[4]:>7} ms  {row[5]:.3f}x  {row[1]}"
        )
    if args.json:
        result = {
            "question": "How many FLOPs and bytes does one training step of ours do at the GPU "
            "recipes' draft shapes, and what step time do they predict on an H200?",
            "command": "uv run --frozen python tools/gpu/step_counts.py --json "
            "docs/benchmarks/step-counts.json",
            "measured": datetime.date.today().isoformat(),
            "versions": {"torch": __import__("torch").__version__},
            "hardware": "a CPU, no GPU (fake cuda:0 tensors; the prediction takes an H200's peaks)",
            "settings": "bf16 autocast without its cache of weight casts (as in compiled "
            "layers), 3 TTT steps, flash attention, eager bytes; 8,192 packed tokens (4 "
            "documents of 2,048) unless stated",
            "tables": [
                {
                    "id": "counts",
                    "title": "One step, counted by part (FLOPs, bytes moved eagerly, and the "
                    "time at the H200's peaks, each op at the bound it meets)",
                    "kind": "grid",
                    "columns": ["shape", "settings", "part", "TFLOP", "GB", "ms at peak"],
                    "rows": grid,
                },
                {
                    "id": "prediction",
                    "title": "Predicted on H200s, per GPU: ours' counted time scaled by the "
                    "measured bench row, against speculators 0.9.0 at its defaults (Muon; a "
                    "prediction but for the bench row)",
                    "kind": "grid",
                    "columns": [
                        "shape",
                        "ours' settings",
                        "GPUs",
                        "ours ms",
                        "speculators ms",
                        "×",
                    ],
                    "rows": predicted,
                },
            ],
        }
        args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
