#!/usr/bin/env python3
"""A fixture where an objective scoring attention before o_proj picks a scale far worse at the output than a deeper
clip: kvcalib's, which scores the attention block's output after o_proj, must not.

scripts/make_constant_k_model.py's mechanism (near-constant K channels on FP8 rounding boundaries flip from token to
token; a clip that saturates them makes them constants, which softmax ignores) in two KV heads of `--layer`, whose K
shares one per-tensor scale:
- KV head 1 (seen): the absmax channel and channels on absmax / fp8_max's rounding boundaries above
  `--clip` x absmax: absmax flips them, every clip from `--clip` down saturates them;
- KV head 0 (hidden): channels on the rounding boundaries of the scale absmax x `--clip` / fp8_max, between
  `--clip` / √2 and `--clip` x absmax: that candidate flips them, the next deeper (x `--clip` / √2) and below saturate
  them. Its v_proj rows are divided by `--hide-scale` s and the o_proj columns reading it multiplied by s: the model is
  the same (the attention output is linear in V), but the head's share of ||ΔO|| / ||O|| before o_proj is s times
  smaller, while the output pays for it in full.
So before o_proj, the objective's rule (the least clipping candidate within 25 % of the best, among clips that halve
absmax's attention error) picks absmax x `--clip`, whose flips in head 0 only the model's output sees.

The planted channels sit on the midpoints of the grid (a cast to nearest: GPU, the default target; no bf16-product
shift for Neuron): a first build measures what the k_proj rows alone put there (their mean over `--dataset`) and the
bias subtracts it, a second measures the absmax the calibration will see. The query heads get ±`--q-bias` in the
planted channels but the absmax channel, whose spread is then all a clip removes there. Measured on SmolLM2 (16 rows of
256 tokens, gpu): scored before o_proj, x0.7071 (attention error 0.37 against absmax's 0.76); next-token KL on
held-out rows x0.7071 0.35, x0.25 0.057, absmax 0.67 (tests/e2e/test_output_fixture.py).

    python scripts/make_output_fixture.py SRC OUT --dataset DATA [--target gpu] [--layer 0] [--clip 0.7071]
        [--hide-scale 32] [--absmax 350] [--q-bias 3] [--k-spread 1.0] [--num-samples 32] [--max-seq-len 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import make_constant_k_model as base  # noqa: E402

SEEN, HIDDEN = 1, 0


def midpoints(scale: float, target_name: str, low: float, count: int = 4) -> list[float]:
    """`count` K values, alternating in sign, whose scaled magnitude sits on the rounding midpoints of the FP8 grid
    just below fp8_max, above `low` x fp8_max (a cast to nearest flips there)."""
    import torch

    from kvcalib.core import fp8  # internal: the chip's FP8 grid, on which the fixture puts K

    chip = fp8.get_target(target_name)
    multiplier = float(fp8.to_fp8_domain(torch.tensor(1.0), scale, chip))
    grid = sorted(
        {
            abs(float(v))
            for v in torch.arange(256, dtype=torch.uint8)
            .view(getattr(torch, chip.dtype))
            .float()
            .tolist()
            if v == v and abs(v) <= chip.fp8_max
        }
    )
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:]) if (a + b) / 2 > low * chip.fp8_max][
        -count:
    ]
    return [(-1.0 if j % 2 == 0 else 1.0) * m / multiplier for j, m in enumerate(mids)]


def values_for(absmax: float, measured: float, target: str, clip: float) -> dict[int, list[float]]:
    """Per KV head, the planted channels' K: the seen head's on absmax's midpoints above `clip`, the hidden head's
    on absmax x `clip`'s midpoints above `clip` / √2 (in absmax x `clip`'s units: above 1 / √2)."""
    from kvcalib.core import fp8  # internal: the chip's FP8 grid, on which the fixture puts K

    chip = fp8.get_target(target)
    scale = float(fp8.scale_from_absmax(measured, chip))
    clipped = float(fp8.scale_from_absmax(measured * clip, chip))
    return {
        SEEN: [absmax, *midpoints(scale, target, clip)],
        HIDDEN: midpoints(clipped, target, 2**-0.5),
    }


def build(
    src: Path,
    out: Path,
    layer: int,
    means: dict[int, list[float]],
    hide_scale: float,
    q_bias: float,
    k_spread: float,
    measured: dict[int, list[float]] | None = None,
) -> None:
    """The variant of `src`: in `layer`, KV head h's planted channels with K mean `means[h]` (k_proj bias: the
    mean less `measured[h]`, what the rows alone gave there, measured on the first pass), their weight rows x
    `k_spread`, the query heads reading them a bias of ±`q_bias` there but on the absmax channel (its spread alone
    would be what a clip removes); the hidden head's V / s, its o_proj columns x s."""
    import torch
    from transformers import AutoTokenizer

    model, head_dim, group = base.with_biases(src)
    channels = base.outlier_dims(head_dim, 8)
    with torch.no_grad():
        attention = model.model.layers[layer].self_attn
        rows = slice(HIDDEN * head_dim, (HIDDEN + 1) * head_dim)
        attention.v_proj.weight[rows].div_(hide_scale)
        attention.o_proj.weight[
            :, HIDDEN * group * head_dim : (HIDDEN + 1) * group * head_dim
        ].mul_(hide_scale)
        for head, values in means.items():
            offsets = (measured or {}).get(head, [0.0] * len(values))
            for j, (d, value) in enumerate(zip(channels, values)):
                attention.k_proj.bias[head * head_dim + d] = value - offsets[j]
                attention.k_proj.weight[head * head_dim + d].mul_(k_spread)
                for q_head in range(head * group, (head + 1) * group):
                    planted = not (head == SEEN and j == 0)
                    sign = 1.0 if (j + q_head) % 2 == 0 else -1.0
                    attention.q_proj.bias[q_head * head_dim + d] = sign * q_bias * planted
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(src).save_pretrained(partial)
    os.replace(partial, out)


def channel_means(
    model_dir: Path, dataset: str, layer: int, num_samples: int, max_seq_len: int
) -> dict[int, list[float]]:
    """Per planted KV head, the mean over the dataset's tokens of k_proj's output, bias excluded, in the planted
    channels."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = load_dataset("json", data_files=dataset, split="train")["text"][:num_samples]
    attention = model.model.layers[layer].self_attn
    head_dim = model.config.head_dim
    seen: list[torch.Tensor] = []
    hook = attention.k_proj.register_forward_hook(
        lambda m, i, o: seen.append((o - m.bias)[0].detach())
    )
    with torch.no_grad():
        for text in texts:
            model(torch.tensor([tokenizer(text)["input_ids"][:max_seq_len]]))
    hook.remove()
    mean = torch.cat(seen).mean(dim=0)
    channels = base.outlier_dims(head_dim, 8)
    return {h: [float(mean[h * head_dim + d]) for d in channels] for h in (HIDDEN, SEEN)}


def make(
    src: Path,
    out: Path,
    dataset: str,
    target: str = "gpu",
    layer: int = 0,
    clip: float = 2**-0.5,
    hide_scale: float = 32.0,
    absmax: float = 350.0,
    q_bias: float = 3.0,
    k_spread: float = 1.0,
    num_samples: int = 32,
    max_seq_len: int = 256,
    bf16_compute: str = "auto",
) -> tuple[dict[int, list[float]], float]:
    """Build the fixture (module docstring); the planted K means per KV head, and the layer's measured absmax."""
    guess = values_for(absmax, absmax, target, clip)
    with (
        tempfile.TemporaryDirectory() as tmp
    ):  # first: the rows' own means there; second: the absmax
        first, second = Path(tmp) / "first", Path(tmp) / "second"
        build(src, first, layer, guess, hide_scale, q_bias, k_spread)
        measured = channel_means(first, dataset, layer, num_samples, max_seq_len)
        build(src, second, layer, guess, hide_scale, q_bias, k_spread, measured)
        found = base.layer_absmax(second, dataset, num_samples, max_seq_len, bf16_compute)[layer]
    values = values_for(absmax, found, target, clip)
    build(src, out, layer, values, hide_scale, q_bias, k_spread, measured)
    return values, found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--target", default="gpu")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--clip", type=float, default=2**-0.5)
    parser.add_argument("--hide-scale", type=float, default=32.0)
    parser.add_argument("--absmax", type=float, default=350.0)
    parser.add_argument("--q-bias", type=float, default=3.0)
    parser.add_argument("--k-spread", type=float, default=1.0)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=256)
    args = parser.parse_args()
    values, measured = make(
        args.src,
        args.out,
        args.dataset,
        args.target,
        args.layer,
        args.clip,
        args.hide_scale,
        args.absmax,
        args.q_bias,
        args.k_spread,
        args.num_samples,
        args.max_seq_len,
    )
    print(
        f"{args.out}: layer {args.layer}, absmax {measured:.1f}; K channels "
        + "; ".join(
            f"KV head {h}: " + ", ".join(f"{v:.1f}" for v in vs) for h, vs in sorted(values.items())
        ),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
