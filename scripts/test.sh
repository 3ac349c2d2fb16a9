#!/usr/bin/env bash
# Install, prepare the real SmolLM2 checkpoint once, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python scripts/prepare_smollm2.py .cache/smollm2
export KVCALIB_SMOLLM2="$PWD/.cache/smollm2" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q "$@"
