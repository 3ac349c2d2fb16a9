#!/usr/bin/env python3
"""eval's orders side by side on the real models: kvcalib's trn2 scales (the default objective) under trn2 in the
Neuron order (a one-piece prefill), the chunked Neuron order (the prompt in 128-token pieces, each reading the
earlier ones from FP8) and the GPU order, and under trn3 per tensor beside trn3's MXFP8 KV cache (which uses no
per-tensor scale). ΔNLL on held-out text (the Python tutorial) with its paired bootstrap interval over rows. Prints
one markdown table per model; nothing is asserted.

    python scripts/bench_orders.py [MODEL ...] [--calib 16x256] [--held-out 4x512] [--out out/orders]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench_accuracy import size  # this folder is on sys.path when run as a script
from provenance import provenance

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RUNS = (
    ("trn2", "neuron"),
    ("trn2", "neuron-chunked"),
    ("trn2", "gpu"),
    ("trn3", "neuron"),
    ("trn3", "mxfp8"),
)


def main() -> None:
    import kvcalib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="*", default=[REPO / ".cache" / "smollm2"])
    parser.add_argument("--calib", type=size, default=(16, 256))
    parser.add_argument("--held-out", type=size, default=(4, 512))
    parser.add_argument("--out", type=Path, default=REPO / "out" / "orders")
    args = parser.parse_args()
    calibration, held_out = REPO / ".cache" / "fortunes.jsonl", REPO / ".cache" / "tutorial.jsonl"
    print(provenance(), flush=True)
    for model in args.models:
        ckpt = args.out / f"{model.name}-trn2"
        if not (ckpt / "config.json").exists():
            kvcalib.calibrate(
                model, str(calibration), ckpt, num_samples=args.calib[0],
                max_seq_len=args.calib[1], bf16_compute="float32", overwrite=True,
            )  # fmt: skip
        print(f"\n{model.name}, {args.held_out[0]} x {args.held_out[1]} tokens\n")
        print("| numerics | order | ΔNLL [95% paired interval] | s |\n| --- | --- | --- | ---: |")
        for target, order in RUNS:
            began = time.perf_counter()
            run = kvcalib.evaluate(
                ckpt, str(held_out), target=target, order=order, num_samples=args.held_out[0],
                max_seq_len=args.held_out[1], layer_rows=0, bf16_compute="float32",
            ).runs[0]  # fmt: skip
            i = run.delta_nll_interval
            print(
                f"| {target} | {order} | {run.delta_nll:+.4f} [{i.low:+.4f}, {i.high:+.4f}] | "
                f"{time.perf_counter() - began:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
