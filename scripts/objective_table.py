#!/usr/bin/env python3
"""The scale objective's promise, measured: per model and chip, kvcalib's default scales against the
simple alternatives, absmax/FP8_MAX, all 1.0 and absmax/448 (llm-compressor's convention).

For each model: calibrate on fortunes with the default objective for trn2, trn3 and gpu, and with
`--scale-objective absmax` for trn2 (absmax/240) and gpu (absmax/448, which is also trn3's); then
`kvcalib eval` on held-out text (the Python tutorial) under each chip's numerics, with every other
scale set as `--compare` and `unit` for 1.0. Prints one markdown table per model: ΔNLL against the
unquantised cache, and whether the default is within 0.01 nats of the best alternative.

    python scripts/objective_table.py MODEL [MODEL ...] [--out out/objective] [--calib 64x512]
            [--held-out 32x512] [--bf16-compute float32]

bf16 runs through float32 matmuls by default (`--bf16-compute float32`): native bf16 is very slow on
CPUs without avx512_bf16, and the comparison is about the KV quantiser, not the matmul kernels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compare_strategies import (  # this folder is on sys.path when run as a script
    KVCALIB,
    REPO,
    dataset,
    run,
)
from provenance import provenance

TARGETS = ("trn2", "trn3", "gpu")
MARGIN = 0.01


def calibrations(
    model: Path, out: Path, calibration: Path, size: tuple[int, int], compute: str
) -> dict[str, Path]:
    """{default-trn2, default-trn3, default-gpu, absmax-trn2, absmax-448} -> checkpoint."""
    plans = {f"default-{t}": ["--target", t] for t in TARGETS}
    plans["absmax-trn2"] = ["--target", "trn2", "--scale-objective", "absmax"]
    plans["absmax-448"] = ["--target", "gpu", "--scale-objective", "absmax"]
    found = {}
    for name, args in plans.items():
        found[name] = out / f"{model.name}-{name}"
        if not (found[name] / "config.json").exists():
            run(
                [
                    *KVCALIB,
                    "calibrate",
                    str(model),
                    "--dataset",
                    str(calibration),
                    "-o",
                    str(found[name]),
                    *args,
                    "--num-samples",
                    str(size[0]),
                    "--max-seq-len",
                    str(size[1]),
                    "--bf16-compute",
                    compute,
                    "--overwrite",
                    "--quiet",
                ]
            )
    return found


def measure(
    ckpts: dict[str, Path], held_out: Path, size: tuple[int, int], compute: str
) -> dict[str, dict]:
    """target -> {scale set -> eval run} for the default, absmax/FP8_MAX, absmax/448 and 1.0."""
    rows = {}
    for target in TARGETS:
        own_absmax = ckpts["absmax-trn2" if target == "trn2" else "absmax-448"]
        others = [own_absmax] + ([ckpts["absmax-448"]] if target == "trn2" else [])
        compare = [a for c in others for a in ("--compare", str(c))] + ["--compare", "unit"]
        result = json.loads(
            run(
                [
                    *KVCALIB,
                    "eval",
                    str(ckpts[f"default-{target}"]),
                    "--dataset",
                    str(held_out),
                    "--target",
                    target,
                    "--num-samples",
                    str(size[0]),
                    "--max-seq-len",
                    str(size[1]),
                    "--bf16-compute",
                    compute,
                    *compare,
                    "--json",
                    "--quiet",
                ]
            )
        )
        names = (
            ["default", "absmax/FP8_MAX"] + (["absmax/448"] if target == "trn2" else []) + ["1.0"]
        )
        rows[target] = {
            "baseline_nll": result["baseline"]["nll"],
            "tokens": result["num_tokens"],
            "runs": dict(zip(names, result["runs"])),
        }
    return rows


def table(title: str, rows: dict[str, dict]) -> str:
    first = next(iter(rows.values()))
    lines = [
        f"### {title} ({first['tokens']:,} held-out tokens, unquantised NLL {first['baseline_nll']:.4f})",
        "",
        "| numerics | default | absmax/FP8_MAX | absmax/448 | 1.0 | default - best alternative | within 0.01 |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for target, row in rows.items():
        d = {name: run["delta_nll"] for name, run in row["runs"].items()}
        if "absmax/448" not in d:
            d["absmax/448"] = d["absmax/FP8_MAX"]  # trn3 and gpu: the same scales
        best = min(d["absmax/FP8_MAX"], d["absmax/448"], d["1.0"])
        lines.append(
            f"| {target} | {d['default']:+.4f} | {d['absmax/FP8_MAX']:+.4f} | {d['absmax/448']:+.4f} | "
            f"{d['1.0']:+.4f} | {d['default'] - best:+.4f} | "
            f"{'yes' if d['default'] <= best + MARGIN else 'NO'} |"
        )
    return "\n".join(lines)


def size(text: str) -> tuple[int, int]:
    n, _, length = text.partition("x")
    return int(n), int(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "objective")
    parser.add_argument(
        "--calib", type=size, default=(64, 512), help="calibration samples x tokens"
    )
    parser.add_argument(
        "--held-out", type=size, default=(32, 512), help="held-out samples x tokens"
    )
    parser.add_argument("--bf16-compute", default="float32", choices=["auto", "native", "float32"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(provenance(), flush=True)
    calibration = dataset(REPO / ".cache" / "fortunes.jsonl", "fortunes")
    held_out = dataset(REPO / ".cache" / "tutorial.jsonl", "python-tutorial")
    for model in args.models:
        ckpts = calibrations(model, args.out, calibration, args.calib, args.bf16_compute)
        rows = measure(ckpts, held_out, args.held_out, args.bf16_compute)
        (args.out / f"{model.name}.json").write_text(json.dumps(rows, indent=1))
        print(table(model.name, rows), flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
