"""A plan: the target's facts and a node, composed into every recipe decision and the totals.

``make_plan`` calls the rules in the order their inputs need (the draft, regeneration, the
sample length, the step, memory, extraction, disk, hours); ``plan_text`` prints each decision
with its reason, and the totals.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from eagle3_recipe import rules
from eagle3_recipe.gpus import Gpu, gpu_kind
from eagle3_recipe.rules import Decision
from eagle3_recipe.sizes import draft_trainable_params
from eagle3_recipe.target import PlanError, Target, read_target

CPU_SAMPLES = 2000  # the tiny pipeline's SAMPLES default


@dataclass(frozen=True)
class Request:
    target: Path
    gpu: str
    gpus: int = 8
    nodes: int = 1
    gpu_memory_gib: float | None = None
    disk_budget_bytes: float | None = None
    max_length: int | None = None  # given by hand: checked against memory, never raised


@dataclass
class Plan:
    target: Target
    gpu: Gpu
    gpus: int
    nodes: int
    decisions: dict[str, Decision] = field(default_factory=dict)
    totals: dict[str, Any] = field(default_factory=dict)

    def add(self, decision: Decision) -> Any:
        self.decisions[decision.name] = decision
        return decision.value

    def value(self, name: str) -> Any:
        return self.decisions[name].value

    def to_json(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            return asdict(v) if is_dataclass(v) and not isinstance(v, type) else v

        return {
            "target": str(self.target.model_dir),
            "architecture": self.target.kind,
            "family": self.target.family.name,
            "gpu": self.gpu.key,
            "gpu_memory_gib": self.gpu.memory_gib,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "decisions": {
                k: {"value": plain(d.value), "reason": d.reason} for k, d in self.decisions.items()
            },
            "totals": self.totals,
        }


def make_plan(request: Request) -> Plan:
    if request.gpus < 1 or request.nodes < 1:
        raise PlanError(f"--gpus {request.gpus} --nodes {request.nodes}: both must be >= 1")
    target = read_target(request.target)
    gpu = gpu_kind(request.gpu, request.gpu_memory_gib)
    plan = Plan(target, gpu, request.gpus, request.nodes)
    t, world = target, request.gpus * request.nodes
    cpu = gpu.key == "cpu"

    aux = plan.add(rules.aux_layer_ids(t.num_layers))
    layer = plan.add(rules.draft_layer(t, gpu))
    vocab = plan.add(rules.draft_vocab(t))
    regen = plan.add(rules.regeneration(t, _generation_config(t.model_dir)))
    samples = CPU_SAMPLES if cpu else plan.add(rules.samples(regen))
    trainable = draft_trainable_params(t.hidden_size, *rules.draft_shape(t, layer), vocab)
    frozen = t.vocab_size * t.hidden_size + vocab * t.hidden_size
    first = "ddp" if 16 * trainable <= rules.ZERO2_ABOVE or world == 1 else "zero2"
    state = rules.training_state_bytes(trainable, frozen, world, first)

    if request.max_length is not None:
        rules.check_fits(request.max_length, request.max_length, gpu, t.hidden_size, state)
        length = plan.add(
            Decision("max_length", request.max_length, "given (--max-length); it fits")
        )
    else:
        length = plan.add(rules.max_length(regen, gpu, t.hidden_size, state, regen.tools))
    largest = rules.largest_fit(gpu, t.hidden_size, state)
    batch = plan.add(rules.tokens_per_batch(length, gpu, largest))
    if not cpu:
        rules.check_fits(length, batch, gpu, t.hidden_size, state)
    accumulation = plan.add(rules.gradient_accumulation(world, batch, gpu))
    tokens_per_step = world * batch * accumulation
    plan.add(rules.learning_rates(t.hidden_size, tokens_per_step, gpu))
    schedule = plan.add(rules.schedule(tokens_per_step, gpu, trainable))
    zero = plan.add(rules.zero_stage(trainable, frozen, world, batch, t.hidden_size, gpu))
    layout = plan.add(rules.extraction_layout(t, gpu, request.gpus, request.nodes, length))
    plan.add(serve_context(t, layout, length))
    expected = rules.expected_tokens(samples, regen)
    bound = samples * length
    store = plan.add(rules.storage(t, len(aux), expected, bound, request.disk_budget_bytes))
    hours = plan.add(
        rules.hours(
            t, gpu, request.gpus, request.nodes, trainable, expected, regen, schedule["epochs"]
        )
    )
    state_now = rules.training_state_bytes(trainable, frozen, world, zero)
    plan.totals = {
        "samples": samples,
        "tokens_expected": expected,
        "tokens_bound": bound,
        "tokens_per_step": tokens_per_step,
        "draft_trainable_params": trainable,
        "disk_expected_bytes": store.expected_bytes,
        "disk_bound_bytes": store.bound_bytes,
        "train_gpu_bytes_per_rank": state_now
        + batch * rules.activation_bytes_per_token(t.hidden_size),
        "extract_weights_bytes_per_gpu": layout.per_gpu_weights,
        "hours": hours,
    }
    return plan


def serve_context(t: Target, layout: rules.Layout, length: int) -> Decision:
    """vllm serve's --max-model-len for regeneration."""
    if layout.tp == 1 and t.max_position_embeddings:
        return Decision(
            "context",
            t.max_position_embeddings,
            f"{t.max_position_embeddings:,}: the model's own context; each replica has a GPU's "
            "KV cache to itself",
        )
    return Decision(
        "context",
        length,
        f"{length:,} (= MAX_LENGTH): one engine shares the KV cache over TP {layout.tp}; a longer "
        "conversation is answered HTTP 400 and counted, never trained cut",
    )


def _generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise PlanError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(data, dict):
        return {}
    for key, least, most in (("temperature", 0.0, 100.0), ("top_p", 0.0, 1.0)):
        value = data.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not least <= value <= most
        ):
            raise PlanError(
                f"{path}: field '{key}' is {value!r}, not a number in [{least:g}, {most:g}]"
            )
    return data


# ---- the printed plan -----------------------------------------------------------------------


def plan_text(plan: Plan) -> str:
    t, g = plan.target, plan.gpu
    lines = [
        f"eagle3-recipe plan: {t.kind} ({t.family.name}; {t.num_layers} layers, hidden "
        f"{t.hidden_size:,}, vocab {t.vocab_size:,}{', MLA' if t.mla else ''}) on {plan.nodes} "
        f"node(s) x {plan.gpus} x {g.name} ({g.memory_gib:g} GiB, {g.bf16_tflops:g} TFLOP/s bf16, "
        f"compute capability {g.compute_capability})",
        "",
    ]
    for d in plan.decisions.values():
        lines.append(f"{d.name}: {_show(d.value)}")
        lines += textwrap.wrap(d.reason, 96, initial_indent="    ", subsequent_indent="    ")
    tot = plan.totals
    hours = tot["hours"]
    lines += [
        "",
        "totals:",
        f"  tokens: ~{tot['tokens_expected'] / 1e6:.1f}M expected ({tot['samples']:,} samples; "
        f"bound {tot['tokens_bound'] / 1e6:.1f}M = SAMPLES x MAX_LENGTH), "
        f"{tot['tokens_per_step']:,} per optimizer step",
        f"  disk: ~{tot['disk_expected_bytes'] / 1e12:.2f} TB of hidden states "
        f"(bound {tot['disk_bound_bytes'] / 1e12:.2f} TB)",
        f"  GPU memory per rank: train {tot['train_gpu_bytes_per_rank'] / 1e9:.1f} GB "
        f"(draft {tot['draft_trainable_params'] / 1e6:,.1f}M trainable); extract weights "
        f"{tot['extract_weights_bytes_per_gpu'] / 1e9:.1f} GB per GPU",
    ]
    if hours:
        lines.append(
            "  hours (estimates): " + ", ".join(f"{stage} {h:.1f} h" for stage, h in hours.items())
        )
    return "\n".join(lines) + "\n"


def _show(value: Any) -> str:
    if is_dataclass(value) and not isinstance(value, type):
        value = {
            k: v
            for k, v in asdict(value).items()
            if not k.endswith(("_bytes", "_weights", "room", "usable"))
        }
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return _fmt(value)


def _fmt(v: Any) -> str:
    if isinstance(v, float) and v < 1e-2:
        return f"{v:.1e}"
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}" if v >= 10000 else str(v)
    return str(v)
