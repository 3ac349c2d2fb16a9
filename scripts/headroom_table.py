#!/usr/bin/env python3
"""`calibrate --headroom`, measured: what short-sample scales clip at long context, and what the
headroom costs at short context.

For each model: calibrate on fortunes (short samples, default 16 x 256 tokens) with the default
scales and with `--headroom H`; then
- `kvcalib eval --context L1,L2,... --saturation-only` on the Python tutorial packed to each length
  (one sample per length): the worst layer's K and V absmax over the largest value the scale
  represents, and how many layers clip (absmax/clip above 1);
- `kvcalib eval` on short held-out samples (default 8 x 256): the ΔNLL of both scale sets against
  the unquantised cache, the headroom's price in FP8 resolution.

    python scripts/headroom_table.py MODEL [MODEL ...] [--lengths 1024,2048,4096,8192] [--headroom 1.4142]
            [--calib 16x256] [--held-out 8x256] [--target trn2] [--out out/headroom]

Lengths above a model's max_position_embeddings are skipped. bf16 runs through float32 matmuls
(`--bf16-compute float32`): quick on every CPU; the question is the KV quantiser's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from compare_strategies import (  # this folder is on sys.path when run as a script
    KVCALIB,
    REPO,
    dataset,
    run,
)
from objective_table import size
from provenance import provenance


def calibrate(
    model: Path, out: Path, calibration: Path, calib: tuple[int, int], target: str, headroom: float
) -> tuple[Path, float]:
    ckpt = out / f"{model.name}-{target}-headroom{headroom:g}"
    started = time.perf_counter()
    run(
        [
            *KVCALIB,
            "calibrate",
            str(model),
            "--dataset",
            str(calibration),
            "-o",
            str(ckpt),
            "--target",
            target,
            "--num-samples",
            str(calib[0]),
            "--max-seq-len",
            str(calib[1]),
            "--headroom",
            str(headroom),
            "--bf16-compute",
            "float32",
            "--overwrite",
            "--quiet",
        ]
    )
    return ckpt, time.perf_counter() - started


def clipping(ckpt: Path, room: Path, held_out: Path, lengths: list[int], target: str) -> list[dict]:
    result = json.loads(
        run(
            [
                *KVCALIB,
                "eval",
                str(ckpt),
                "--dataset",
                str(held_out),
                "--target",
                target,
                "--context",
                ",".join(map(str, lengths)),
                "--saturation-only",
                "--num-samples",
                "1",
                "--compare",
                str(room),
                "--bf16-compute",
                "float32",
                "--json",
                "--quiet",
            ]
        )
    )
    return result["rows"]


def short_delta(
    ckpt: Path, room: Path, held_out: Path, held: tuple[int, int], target: str
) -> list[dict]:
    result = json.loads(
        run(
            [
                *KVCALIB,
                "eval",
                str(ckpt),
                "--dataset",
                str(held_out),
                "--target",
                target,
                "--num-samples",
                str(held[0]),
                "--max-seq-len",
                str(held[1]),
                "--compare",
                str(room),
                "--layer-rows",
                "0",
                "--bf16-compute",
                "float32",
                "--json",
                "--quiet",
            ]
        )
    )
    return [
        {"delta_nll": r["delta_nll"], "interval": r.get("delta_nll_interval")}
        for r in result["runs"]
    ]


def delta(run: dict) -> str:
    spread = run["interval"]
    return f"{run['delta_nll']:+.4f}" + (
        "" if not spread else f" [{spread['low']:+.4f}, {spread['high']:+.4f}]"
    )


def clipped_layers(row: dict, kind: str) -> int:
    return sum(
        1
        for layer in row["layers"]
        if layer[f"{kind}_clip_at"] > 0 and layer[f"{kind}_absmax"] > layer[f"{kind}_clip_at"]
    )


def table(
    model: str,
    rows: list[dict],
    deltas: list[dict],
    seconds: list[float],
    headroom: float,
    args: argparse.Namespace,
) -> str:
    names = ["default", f"headroom {headroom:g}"]
    lines = [
        f"### {model} ({args.target}; calibrated on {args.calib[0]} x {args.calib[1]} fortunes)",
        "",
        "| length | scales | K absmax/clip | V absmax/clip | layers clipping (K, V) |",
        "|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        name = names[0] if row["name"] == "checkpoint" else names[1]
        lines.append(
            f"| {row['length']:,} | {name} | {row['k_beyond']:.2f} | {row['v_beyond']:.2f} | "
            f"{clipped_layers(row, 'k')}, {clipped_layers(row, 'v')} |"
        )
    lines += [
        "",
        f"Short context ({args.held_out[0]} x {args.held_out[1]} tutorial tokens): ΔNLL "
        f"{delta(deltas[0])} default, {delta(deltas[1])} with headroom (95% paired intervals); calibration "
        f"{seconds[0]:.0f} s and {seconds[1]:.0f} s.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--headroom", type=float, default=2**0.5)
    parser.add_argument(
        "--calib", type=size, default=(16, 256), help="calibration samples x tokens"
    )
    parser.add_argument(
        "--held-out", type=size, default=(8, 256), help="short held-out samples x tokens"
    )
    parser.add_argument("--target", default="trn2")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "headroom")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(provenance(), flush=True)
    calibration = dataset(REPO / ".cache" / "fortunes.jsonl", "fortunes")
    held_out = dataset(REPO / ".cache" / "tutorial.jsonl", "python-tutorial")
    for model in args.models:
        config = json.loads((model / "config.json").read_text())
        limit = config.get("max_position_embeddings") or config.get("text_config", {}).get(
            "max_position_embeddings"
        )
        lengths = [n for n in map(int, args.lengths.split(",")) if not limit or n <= limit]
        (short, t0), (room, t1) = (
            calibrate(model, args.out, calibration, args.calib, args.target, h)
            for h in (1.0, args.headroom)
        )
        rows = clipping(short, room, held_out, lengths, args.target)
        deltas = short_delta(short, room, held_out, args.held_out, args.target)
        (args.out / f"{model.name}.json").write_text(
            json.dumps({"rows": rows, "short_delta_nll": deltas}, indent=1)
        )
        print(table(model.name, rows, deltas, [t0, t1], args.headroom, args), flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
