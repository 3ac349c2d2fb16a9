#!/usr/bin/env python3
"""Turn a Llama checkpoint into an equivalent "outlier-K" variant for FP8-KV tests and demos.

k_proj weights x F and q_proj / F (optionally v_proj x F and o_proj / F too), F a power of
two (default 16). Without quantisation its outputs are identical, bit for bit in bf16:
scaling by a power of two is exact, RoPE is linear, and q·k and softmax(.)·V·O are
unchanged. Its K (and V) absmax is F times larger, like the outlier keys real models such
as Qwen2 have: with scale 1.0 on trn2 (clamp at 240) such K clip badly; calibrated scales
do not. (Not for models with k-norm, e.g. Qwen3: the norm would undo the factor.)

With --head H only KV head H is scaled (its k_proj rows x F, the q_proj rows of the query heads
that attend to it / F): one outlier head, the case per-head KV scales are made for.

    python scripts/make_outlier_model.py SRC OUT [--factor 16] [--with-v] [--head H]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path


def _head_rows(module, head: int | None, kv: bool) -> slice:
    """The output rows of q_proj (kv False) or k_proj/v_proj (kv True) that belong to KV head `head`."""
    if head is None:
        return slice(None)
    config = module.config
    head_dim = getattr(module, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    if not 0 <= head < config.num_key_value_heads:
        sys.exit(f"--head {head}: the model has {config.num_key_value_heads} KV heads")
    width = head_dim * (1 if kv else group)
    return slice(head * width, (head + 1) * width)


def make_outlier(
    src: Path, out: Path, factor: float, with_v: bool, head: int | None = None
) -> None:
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
        for module in model.modules():
            if not (hasattr(module, "q_proj") and hasattr(module, "k_proj")):
                continue
            if with_v and head is not None:
                sys.exit("--with-v and --head: one of them")
            pairs = [
                (module.k_proj, factor, _head_rows(module, head, True)),
                (module.q_proj, 1.0 / factor, _head_rows(module, head, False)),
            ]
            if with_v:
                pairs += [
                    (module.v_proj, factor, slice(None)),
                    (module.o_proj, 1.0 / factor, slice(None)),
                ]
            for linear, f, rows in pairs:
                linear.weight[rows].mul_(f)
                if linear.bias is not None and linear is not module.o_proj:
                    linear.bias[rows].mul_(f)
            scaled += 1
    if not scaled:
        sys.exit(f"{src}: no attention module with q_proj/k_proj found")
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(src).save_pretrained(partial)
    os.replace(partial, out)
    print(
        f"{out}: {scaled} attention layers, K x{factor:g}"
        + (f" on KV head {head}" if head is not None else "")
        + (f", V x{factor:g}" if with_v else ""),
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--factor", type=float, default=16.0)
    parser.add_argument("--with-v", action="store_true", help="also v_proj x F and o_proj / F")
    parser.add_argument(
        "--head", type=int, default=None, help="scale only this KV head's K (and its queries' Q)"
    )
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out} exists")
    make_outlier(args.src, args.out, args.factor, args.with_v, args.head)


if __name__ == "__main__":
    main()
