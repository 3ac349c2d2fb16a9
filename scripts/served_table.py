#!/usr/bin/env python3
"""A calibrated checkpoint on every server it is for: its ΔNLL under each numerics its scales are served with.

A trn2 checkpoint (scales sized for FP8 max 240) also runs on trn3, GPU vLLM and vLLM CPU (448), where the
same scale saturates at 448 x s: the scale objective scores every candidate on each of them
(kvcalib.core.fp8.served_numerics). For each CHECKPOINT this runs `kvcalib eval` on held-out text (the
Python tutorial) under each of those numerics, with `--compare` for the other checkpoints given (another
kvcalib version's, absmax's) and `unit` (every scale 1.0), and prints a markdown table of ΔNLL against the
unquantised cache with its 95 % interval, headed by the command, the commit, the date and the CPU.

    python scripts/served_table.py CKPT [CKPT ...] [--compare OTHER ...] [--held-out 16x256]
            [--bf16-compute auto]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from compare_strategies import (  # this folder is on sys.path when run as a script
    KVCALIB,
    REPO,
    dataset,
    run,
)
from objective_table import size
from provenance import provenance

sys.path.insert(0, str(REPO))
from kvcalib.core import fp8  # noqa: E402


def table(
    ckpt: Path, compare: list[Path], held_out: Path, rows: tuple[int, int], compute: str
) -> str:
    target = json.loads((ckpt / "kvcalib_calibration.json").read_text())["target"]
    names = [ckpt.name, *(c.name for c in compare), "1.0"]
    lines = [
        f"### {ckpt.name} (calibrated for {target})",
        "",
        "| numerics | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for numerics in fp8.served_numerics(fp8.get_target(target)):
        result = json.loads(
            run(
                [
                    *KVCALIB,
                    "eval",
                    str(ckpt),
                    "--dataset",
                    str(held_out),
                    "--target",
                    numerics.name,
                    "--num-samples",
                    str(rows[0]),
                    "--max-seq-len",
                    str(rows[1]),
                    "--bf16-compute",
                    compute,
                    "--layer-rows",
                    "0",
                    *[a for c in compare for a in ("--compare", str(c))],
                    "--compare",
                    "unit",
                    "--json",
                    "--quiet",
                ]
            )
        )
        cells = []
        for r in result["runs"]:
            i = r["delta_nll_interval"]
            cells.append(f"{r['delta_nll']:+.4f} [{i['low']:+.4f}, {i['high']:+.4f}]")
        lines.append(f"| {numerics.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", type=Path, nargs="+")
    parser.add_argument(
        "--compare",
        type=Path,
        action="append",
        default=[],
        help="another checkpoint of the same model, scored beside each CHECKPOINT (the same order)",
    )
    parser.add_argument(
        "--held-out", type=size, default=(16, 256), help="held-out samples x tokens"
    )
    parser.add_argument("--bf16-compute", default="auto", choices=["auto", "native", "float32"])
    args = parser.parse_args()
    held_out = dataset(REPO / ".cache" / "tutorial.jsonl", "python-tutorial")
    print(
        provenance() + "; ΔNLL against the unquantised cache [95 % interval over rows]", flush=True
    )
    for i, ckpt in enumerate(args.checkpoints):
        others = (
            args.compare[i : i + 1] if len(args.compare) == len(args.checkpoints) else args.compare
        )
        print("\n" + table(ckpt, others, held_out, args.held_out, args.bf16_compute), flush=True)


if __name__ == "__main__":
    main()
