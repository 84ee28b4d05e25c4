#!/usr/bin/env bash
# The GPU check on one NVIDIA GPU node (.whl/, made by tools/gpu/gpu_wheels.sh, copied beside the repository):
#   bash tools/gpu/gpu_check.sh            # installs the wheels the image lacks, runs gpu_check.py
#   bash tools/gpu/gpu_check.sh --plan     # the parts, their order and budgets, nothing run
# Everything it prints also goes to $OUT/gpu_check.log, the table to $OUT/gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}"
if ls .whl/*.whl >/dev/null 2>&1; then
  # only the distributions the image lacks: torch and transformers run on the image's own
  # (typing-extensions, idna, …), which a carried wheel earlier on the path would override
  mapfile -t lacking < <(python3 tools/gpu/wheels_to_install.py .whl/*.whl)
  if ((${#lacking[@]})); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site "${lacking[@]}" || exit 1
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 tools/gpu/gpu_check.py --json "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
