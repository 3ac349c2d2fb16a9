#!/usr/bin/env bash
# Install kvcalib into ./.venv on a fresh machine: torch pinned first (a CPU wheel), then the
# project with its test extras, then Debian's `fortunes` (real prose for the demo and tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# uv installs (about 10 s where pip takes 100). It reads pip's find-links (the CPU torch wheel on disk) from here.
.venv/bin/python -m pip install -q --disable-pip-version-check uv==0.13.9
export UV_FIND_LINKS=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}}
uv_install() { .venv/bin/python -m uv pip install -q --python "$1" "${@:2}"; }
# torch first and pinned, the local CPU build preferred: an unpinned torch would pull a multi-GB CUDA build.
uv_install .venv/bin/python --index-strategy unsafe-best-match torch==2.13.0
uv_install .venv/bin/python -c scripts/constraints.txt -e '.[dev]'
# Real prose for calibration (fortunes) and held-out evaluation (the Python tutorial).
if [ ! -f /usr/share/games/fortunes/fortunes ] || [ ! -d /usr/share/doc/python3.11/html/_sources/tutorial ]; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq fortunes python3.11-doc) >/dev/null
  else
    echo "install Debian's fortunes and python3.11-doc packages (sudo apt-get install ...) for the demo data" >&2
  fi
fi
