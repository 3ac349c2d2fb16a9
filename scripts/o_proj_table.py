#!/usr/bin/env python3
"""The attention objective scored after o_proj (this checkout's default) against the attention objective plus the
whole-model step (the default before it, run from another checkout), paired on the same held-out rows.

Calibrates MODEL for TARGET on DATA (its first --calib rows) here and, in a subprocess from --old (a checkout
before the change, e.g. `git worktree add ../kvcalib-old e5dd8bf`), with that checkout's default; then `evaluate`s
this checkout's on HELD_OUT (its first --held-out rows) in the target's numerics and server order, the old one
compared on the same rows. Prints one JSON line: both ΔNLL intervals, the paired difference (new - old), the
layer-kinds whose choice differs, and the old run's step record.

    OMP_NUM_THREADS=1 python scripts/o_proj_table.py MODEL NAME TARGET OUT --data DATA --held-out-data HELD_OUT
        --old ../kvcalib-old [--calib 32x512] [--held-out 16x512] [--bf16-compute auto]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import kvcalib
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core import fp8
from kvcalib.evaluation.pipeline import EvalOptions, evaluate
from kvcalib.evaluation.significance import paired_bootstrap
from kvcalib.hf.data import load_calibration_data
from kvcalib.hf.model import load_tokenizer


def size(text: str) -> tuple[int, int]:
    n, _, length = text.partition("x")
    return int(n), int(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("model", "name", "target", "out"):
        parser.add_argument(name)
    parser.add_argument("--data", required=True)
    parser.add_argument("--held-out-data", required=True)
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--calib", type=size, default=(32, 512))
    parser.add_argument("--held-out", type=size, default=(16, 512))
    parser.add_argument("--bf16-compute", default="auto")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, length = args.calib
    new_ck, old_ck = out / f"{args.name}-{args.target}-new", out / f"{args.name}-{args.target}-old"
    new = kvcalib.to_json(
        calibrate(
            args.model,
            args.data,
            new_ck,
            CalibrateOptions(
                target=args.target,
                num_samples=rows,
                max_seq_len=length,
                bf16_compute=args.bf16_compute,
                overwrite=True,
            ),
        )
    )
    command = [sys.executable, "-m", "kvcalib", "calibrate", args.model, "--dataset", args.data]
    command += ["--output", str(old_ck), "--target", args.target, "--num-samples", str(rows)]
    command += ["--max-seq-len", str(length), "--bf16-compute", args.bf16_compute, "--json"]
    # cwd: `python -m` puts the working directory first on sys.path, so the old checkout's kvcalib runs
    run = subprocess.run(command + ["--overwrite"], cwd=args.old, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    old = json.loads(run.stdout)
    differ = [
        (a["layer"], k, b[k]["choice"]["label"], a[k]["choice"]["label"])
        for a, b in zip(new["layers"], old["layers"])
        for k in "kv"
        if a[k]["choice"]["label"] != b[k]["choice"]["label"]
    ]
    held_rows, held_length = args.held_out
    opts = EvalOptions(
        target=args.target,
        num_samples=held_rows,
        max_seq_len=held_length,
        compare=(str(old_ck),),
        layer_rows=0,
        bf16_compute=args.bf16_compute,
    )
    result = evaluate(new_ck, args.held_out_data, opts)
    mine, theirs = result.runs
    data = load_calibration_data(args.held_out_data, load_tokenizer(Path(args.model), False), opts)
    fresh = result.order == fp8.NEURON_ORDER
    tokens = [len(s) // 2 - 1 if fresh else len(s) - 1 for s in data.sequences]
    diffs = [float(d.sum()) for d in (mine.token_nll - theirs.token_nll).split(tokens)]
    line = {
        "model": args.name,
        "target": args.target,
        "order": result.order,
        "tokens": result.num_tokens,
        "new": kvcalib.to_json(mine.delta_nll_interval),
        "old": kvcalib.to_json(theirs.delta_nll_interval),
        "new_minus_old": kvcalib.to_json(paired_bootstrap(diffs, tokens)),
        "differ (layer, kind, old, new)": differ,
        "old_step": old.get("output_step"),
        "seconds (new, old)": (round(new["seconds"], 1), round(old["seconds"], 1)),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
