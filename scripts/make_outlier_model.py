#!/usr/bin/env python3
"""Turn a Llama checkpoint into an equivalent "outlier-K" variant for FP8-KV tests and demos.

k_proj weights x F and q_proj / F (optionally v_proj x F and o_proj / F too), F a power of
two (default 16). Without quantisation its outputs are identical, bit for bit in bf16:
scaling by a power of two is exact, RoPE is linear, and q·k and softmax(.)·V·O are
unchanged. Its K (and V) absmax is F times larger, like the outlier keys real models such
as Qwen2 have: with scale 1.0 on trn2 (clamp at 240) such K clip badly; calibrated scales
do not. (Not for models with k-norm, e.g. Qwen3: the norm would undo the factor.)

    python scripts/make_outlier_model.py SRC OUT [--factor 16] [--with-v]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path


def make_outlier(src: Path, out: Path, factor: float, with_v: bool) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if factor <= 0 or math.log2(factor) != int(math.log2(factor)):
        sys.exit(f"--factor must be a power of two (exact in floating point), not {factor}")
    config = AutoConfig.from_pretrained(src)
    for attr in ("quantization_config", "compression_config"):  # the variant is unquantised
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype="auto")
    scaled = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not (hasattr(module, "q_proj") and hasattr(module, "k_proj")):
                continue
            pairs = [(module.k_proj, factor), (module.q_proj, 1.0 / factor)]
            if with_v:
                pairs += [(module.v_proj, factor), (module.o_proj, 1.0 / factor)]
            for linear, f in pairs:
                linear.weight.mul_(f)
                if linear.bias is not None and linear in (module.k_proj, module.v_proj):
                    linear.bias.mul_(f)
            scaled += 1
    if not scaled:
        sys.exit(f"{src}: no attention module with q_proj/k_proj found")
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(src).save_pretrained(partial)
    os.replace(partial, out)
    print(f"{out}: {scaled} attention layers, K x{factor:g}" + (f", V x{factor:g}" if with_v else ""), file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--factor", type=float, default=16.0)
    parser.add_argument("--with-v", action="store_true", help="also v_proj x F and o_proj / F")
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out} exists")
    make_outlier(args.src, args.out, args.factor, args.with_v)


if __name__ == "__main__":
    main()
