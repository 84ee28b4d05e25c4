#!/usr/bin/env bash
# Which traffic to train a draft on, for a target that thinks and calls tools: the
# agent recipe's pipeline once per arm and seed, each draft measured by vLLM on the same held-out
# prompts of every kind (instant / thinking / agent), then one table of AL per kind and seed.
#
#   bash tools/bench/bench_traffic_mix.sh [OUT_DIR] [SEEDS]     (default runs/traffic-mix, "0 1 2")
#
# Arms, drafts of the same size and steps (STEPS, 150, taken whatever an arm's data size): (a)
# instant rows only, (b) thinking + agent rows only, (c) every row (the corpus's mix, 30 % / 30 % /
# 40 %). A later seed reuses its arm's data and hidden states (hard links) and trains and
# measures anew (TRAIN_SEED). The drafts of the arms in K5_ARMS ("c-mix") are also measured at
# k = 5 (eval-vllm-k5/). Run it on a quiet machine: one arm at a time, nothing beside it.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-runs/traffic-mix}"
seeds="${2:-0 1 2}"
declare -A kinds=([a-instant]=instant [b-thinking-agent]=thinking,agent [c-mix]=)
for seed in $seeds; do
  for arm in a-instant b-thinking-agent c-mix; do
    run="$out/$arm/seed-$seed"
    first="$out/$arm/seed-${seeds%% *}"
    if [ ! -d "$run" ] && [ "$run" != "$first" ] && [ -d "$first/hidden_states" ]; then
      mkdir -p "$run"  # the arm's data and states, not its draft or its measurements
      for f in "$first"/*; do
        case "$(basename "$f")" in train|eval-*) ;; *) cp -al "$f" "$run/" ;; esac
      done
    fi
    mkdir -p "$run"
    echo "== $arm seed $seed ($(date +%T))"
    TRAIN_KINDS="${kinds[$arm]}" TRAIN_SEED="$seed" PROMPTS="${PROMPTS:-60}" \
      bash recipes/tiny-agent/pipeline.sh "$run" > "$run.log" 2>&1 || { tail -20 "$run.log"; exit 1; }
    if [[ " ${K5_ARMS-c-mix} " == *" $arm "* ]] && [ ! -d "$run/eval-vllm-k5" ]; then
      target=recipes/tiny-agent/target  # the pipeline's held-out prompts, at k = 5
      uv run --frozen eagle3-eval vllm --draft "$run/train/draft" --target "$target" --k 5 \
        --prompts "$run/corpus.jsonl" --split none --heldout-sources "$target/build_info.json" \
        --limit "${PROMPTS:-60}" --max-new-tokens 128 --concurrency "${PROMPTS:-60}" --no-card \
        --vllm-python "${EAGLE3_VLLM_PYTHON:-$(tools/ci/setup_vllm_cpu.sh)}" \
        --out "$run/eval-vllm-k5" >> "$run.log" 2>&1 || { tail -20 "$run.log"; exit 1; }
    fi
  done
done
uv run --frozen python - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path

sys.path.insert(0, "tools/bench")
from tiny_runs import trained_steps

out = Path(sys.argv[1])
kinds = ("instant", "thinking", "agent")

print(f"{'arm':22} {'seed':>4} {'steps':>5}  " + "  ".join(f"{k:>22}" for k in (*kinds, "all")))
for arm, reading in sorted((a, e) for a in out.iterdir() if a.is_dir() for e in ("eval-vllm", "eval-vllm-k5")):
    per = {k: [] for k in (*kinds, "all")}
    name = arm.name + (" k=5" if reading.endswith("k5") else "")
    for run in sorted(arm.glob("seed-*")):
        report = run / reading / "report.json"
        if not report.is_file():
            continue
        r = json.loads(report.read_text())
        rows = {g["kind"]: g for g in r["kinds"]} | {"all": r}
        cells = []
        for k in (*kinds, "all"):
            g = rows[k]
            per[k].append(g["acceptance_length"])
            pos = "/".join(f"{p:.2f}" for p in g["per_position_acceptance"])
            cells.append(f"{g['acceptance_length']:.3f} ({pos})")
        print(f"{name:22} {run.name[5:]:>4} {trained_steps(run / 'train' / 'metrics.jsonl'):>5}  " + "  ".join(f"{c:>22}" for c in cells))
    if len(per["all"]) > 1:
        print(f"{name:22} mean        " + "  ".join(f"{statistics.mean(v):>22.3f}" for v in per.values()))
PY
