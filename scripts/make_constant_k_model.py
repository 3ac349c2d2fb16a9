#!/usr/bin/env python3
"""Give a Llama checkpoint near-constant outlier K channels: the case where absmax / fp8_max is the worst scale.

Real models with q/k biases (Qwen2.5) have K channels in the RoPE pairs that barely rotate
which sit at |K| of a few hundred with a spread of about one across tokens. `absmax / fp8_max`
then puts them on a coarse part of the FP8 grid; a channel whose value sits on a rounding
boundary flips between two grid points from token to token, and that noise, multiplied into
q·k, scrambles attention. A clipped scale saturates them into exact constants, which softmax
ignores.

This script builds that mechanism into SmolLM2 (or any Llama whose attention has no biases):
attention biases are switched on (all zero), then in each layer of `--layer` and KV head of `--head`:
- k_proj's bias moves 2 x `--dims` channels, the first halves of the lowest-frequency RoPE
  pairs, to large constants: one at `--absmax`, the others on the FP8 rounding boundaries (the
  midpoints between grid values 128..240 in scaled units, where a cast to nearest flips; with
  `--boundaries toward-zero` the grid values, where vLLM CPU's truncating cast flips; `both`
  alternates them) of the scale absmax / fp8_max would take, measured on `--dataset` first (with
  `--grid-factor F`, of the scale absmax x F / fp8_max: the objective's candidate `absmax xF`; 0.7071
  makes the output cost non-monotone in the clip, that candidate flipping more than absmax or x0.5);
- k_proj's weight rows of those channels are scaled by `--k-spread` (1.5): their spread across
  tokens becomes 0.7-2, a few steps of bf16 (1 in 128..256, 2 in 256..512), enough to cross a
  rounding boundary, too little to carry much of the attention. K is bf16, and on Neuron so is
  the product x * r: with a spread under half a bf16 step (0.25 did that on SmolLM2) a channel is
  one bf16 value for every token and sits at one grid value, a constant that softmax ignores;
- q_proj's bias gives the query heads that read that KV head weight ±`--q-bias` in those dims.
Without quantisation the model is nearly unchanged (a constant added to every key's q·k is what
softmax ignores; these pairs rotate by < 0.05 rad over 256 tokens): the script prints both NLLs.

    python scripts/make_constant_k_model.py SRC OUT --dataset DATA [--target trn2] [--layer 0[,1..]]
        [--head 0[,1..]] [--dims 4] [--absmax 350] [--q-bias 3] [--k-spread 1.5]
        [--boundaries nearest|toward-zero|both] [--grid-factor 1.0] [--num-samples 32] [--max-seq-len 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def outlier_dims(head_dim: int, count: int) -> list[int]:
    """The first halves of the `count` lowest-frequency rotary pairs (transformers' rotate_half layout).

    A constant c in the first half of a pair rotates into c·cos θ there (second order in θ: a
    constant for q·k) and c·sin θ in the second half, which gets no query bias."""
    half = head_dim // 2
    return list(range(half - count, half))


BOUNDARIES = ("nearest", "toward-zero", "both")


def boundary_values(
    scale: float, target_name: str, count: int, absmax: float, boundaries: str = "nearest"
) -> list[float]:
    """`count` channel means: the largest at `absmax`, the rest where the scaled value sits on a rounding boundary
    of the FP8 grid values 128..240, alternating in sign. A cast that rounds to nearest flips at the midpoints
    (136, 152, ...); one that truncates toward zero (vLLM on CPU) at the grid values themselves (144, 160, ...);
    `both` alternates the two, so the mechanism bites whichever the server does."""
    import torch

    from kvcalib.core import fp8  # internal: the chip's FP8 grid, on which the fixture puts K

    chip = fp8.get_target(target_name)
    multiplier = float(fp8.to_fp8_domain(torch.tensor(1.0), scale, chip))
    # a bf16 product (Neuron) makes a midpoint one bf16 value, cast to the even grid value for every token: the
    # flip sits half a bf16 step (0.5 in 128..256) to the odd side
    shift = [(0.5 if j % 2 == 0 else -0.5) if chip.bf16_product else 0.0 for j in range(7)]
    midpoints = [136.0 + 16.0 * j + shift[j] for j in range(7)]
    grid = [144.0 + 16.0 * j for j in range(7)]
    values = [absmax]
    for j in range(count - 1):
        sign = -1.0 if j % 2 == 0 else 1.0
        toward_zero = boundaries == "toward-zero" or (boundaries == "both" and (j // 2) % 2 == 1)
        places = grid if toward_zero else midpoints
        values.append(sign * places[j % len(places)] / multiplier)
    return values


def with_biases(src: Path):
    """`src` loaded with attention biases switched on, all zero: (model, head_dim, query heads per KV head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    if getattr(config, "attention_bias", None) is None:
        sys.exit(f"{src}: not a Llama-style config (no attention_bias)")
    config.attention_bias = True
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype="auto")
    with torch.no_grad():
        for module in model.modules():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                linear = getattr(module, name, None)
                if isinstance(linear, torch.nn.Linear) and linear.bias is not None:
                    linear.bias.zero_()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return model, head_dim, config.num_attention_heads // config.num_key_value_heads


def build(
    src: Path,
    out: Path,
    k_values: dict[int, list[float]],
    heads: list[int],
    dims: int,
    q_bias: float,
    k_spread: float,
) -> None:
    """The variant of `src` with `k_values[layer]` as the outlier channels' K bias in every KV head of `heads`."""
    import torch
    from transformers import AutoTokenizer

    model, head_dim, group = with_biases(src)
    with torch.no_grad():
        channels = outlier_dims(head_dim, 2 * dims)
        for layer, values in k_values.items():
            attention = model.model.layers[layer].self_attn
            for head in heads:
                for d, value in zip(channels, values):
                    attention.k_proj.bias[head * head_dim + d] = value
                    attention.k_proj.weight[head * head_dim + d].mul_(
                        k_spread
                    )  # what varies across tokens: small
                for q_head in range(head * group, (head + 1) * group):
                    for j, d in enumerate(channels):
                        attention.q_proj.bias[q_head * head_dim + d] = (
                            q_bias if (j + q_head) % 2 == 0 else -q_bias
                        )
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(src).save_pretrained(partial)
    os.replace(partial, out)


def layer_absmax(
    model: Path, dataset: str, num_samples: int, max_seq_len: int, bf16_compute: str = "auto"
) -> list[float]:
    """Every layer's K absmax, as `kvcalib calibrate` measures it on this machine (with `bf16_compute`)."""
    import kvcalib

    with tempfile.TemporaryDirectory() as tmp:
        result = kvcalib.calibrate(
            model,
            dataset,
            Path(tmp) / "out",
            num_samples=num_samples,
            max_seq_len=max_seq_len,
            scale_objective="absmax",
            bf16_compute=bf16_compute,
        )
    return [layer.k.absmax for layer in result.layers]


def make(
    src: Path,
    out: Path,
    dataset: str,
    target: str = "trn2",
    layer: int | list[int] = 0,
    head: int | list[int] = 0,
    dims: int = 4,
    absmax: float = 350.0,
    q_bias: float = 3.0,
    k_spread: float = 1.5,
    num_samples: int = 32,
    max_seq_len: int = 256,
    boundaries: str = "nearest",
    grid_factor: float = 1.0,
    bf16_compute: str = "auto",
) -> tuple[list[float], float, float]:
    """Build the variant (the mechanism in every KV head of `head` of every layer of `layer`); the first layer's
    K channel values, its measured absmax and the scale whose grid they sit on (absmax x `grid_factor` / fp8_max)
    on `target`. `bf16_compute`: how the absmax is measured, as the calibration that reads the variant computes."""
    from kvcalib.core import fp8  # internal: the chip's FP8 grid, on which the fixture puts K

    layers = [layer] if isinstance(layer, int) else list(layer)
    heads = [head] if isinstance(head, int) else list(head)
    chip = fp8.get_target(target)
    count = 2 * dims
    with tempfile.TemporaryDirectory() as tmp:  # first pass: where absmax / fp8_max puts the grid
        first = Path(tmp) / "first"
        guess = boundary_values(
            absmax * grid_factor / chip.fp8_max, target, count, absmax, boundaries
        )
        build(src, first, {i: guess for i in layers}, heads, dims, q_bias, k_spread)
        measured = layer_absmax(first, dataset, num_samples, max_seq_len, bf16_compute)
    scales = {i: float(fp8.scale_from_absmax(measured[i] * grid_factor, chip)) for i in layers}
    values = {i: boundary_values(scales[i], target, count, absmax, boundaries) for i in layers}
    build(src, out, values, heads, dims, q_bias, k_spread)
    return values[layers[0]], measured[layers[0]], scales[layers[0]]


def _numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--target", default="trn2")
    parser.add_argument("--layer", type=_numbers, default=[0], help="the layer, or layers: 0,1,2")
    parser.add_argument("--head", type=_numbers, default=[0], help="the KV head, or heads: 0,1")
    parser.add_argument(
        "--dims", type=int, default=4, help="2x this many channels (the lowest-frequency pairs)"
    )
    parser.add_argument("--absmax", type=float, default=350.0)
    parser.add_argument("--q-bias", type=float, default=3.0)
    parser.add_argument(
        "--k-spread", type=float, default=1.5, help="k_proj rows of those channels x this"
    )
    parser.add_argument(
        "--boundaries",
        choices=BOUNDARIES,
        default="nearest",
        help="the rounding boundaries the channels sit on: of a cast to nearest (Neuron, GPU), "
        "of vLLM CPU's truncating cast, or both",
    )
    parser.add_argument(
        "--grid-factor",
        type=float,
        default=1.0,
        help="the channels sit on the boundaries of the scale absmax x this / fp8_max (0.7071: the "
        "objective's absmax x0.7071)",
    )
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=256)
    args = parser.parse_args()
    values, measured, scale = make(
        args.src,
        args.out,
        args.dataset,
        args.target,
        args.layer,
        args.head,
        args.dims,
        args.absmax,
        args.q_bias,
        args.k_spread,
        args.num_samples,
        args.max_seq_len,
        args.boundaries,
        args.grid_factor,
    )
    print(
        f"{args.out}: layer {','.join(map(str, args.layer))} KV head {','.join(map(str, args.head))}, "
        f"K channels (layer {args.layer[0]}) at "
        f"{', '.join(f'{v:.1f}' for v in values)} (absmax {measured:.1f}, scale {scale:.4g} on {args.target}); "
        f"q bias ±{args.q_bias:g}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
