#!/usr/bin/env python3
"""Per-tensor KV, per-head KV and FP8 attention side by side on one model (and its outlier-K variant).

Calibrates MODEL on fortunes (128 samples, 512 tokens, Q observed too) for trn2, trn3, gpu and gpu per
head, then evaluates on held-out text (32 samples of the Python tutorial, as in the README's eval
section) with each target's numerics, and prints one markdown table per model: ΔNLL, KL, top-1
against the unquantised run, and the worst layer's K and Q SQNR.

    python scripts/compare_strategies.py [--model .cache/smollm2] [--out out/strategies]
            [--variant 16] [--variant 256@0] [--no-base]

A variant F is the outlier-K model (scripts/make_outlier_model.py: every K x F, Q / F); F@H scales
KV head H only (one outlier head, what per-head scales are for).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
KVCALIB = [sys.executable, "-m", "kvcalib"]
CALIBRATIONS = {
    "trn2": ["--target", "trn2"],
    "trn3": ["--target", "trn3"],
    "gpu": ["--target", "gpu"],
    "gpu-head": ["--target", "gpu", "--strategy", "attn_head"],
}


def run(args: list[str]) -> str:
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{done.stderr[-2000:]}")
    return done.stdout


def dataset(path: Path, source: str) -> Path:
    if not path.exists():
        run(
            [
                sys.executable,
                str(REPO / "scripts" / "make_text_dataset.py"),
                str(path),
                "--source",
                source,
            ]
        )
    return path


def rows(model: Path, out: Path, calibration: Path, held_out: Path) -> list[tuple[str, dict]]:
    ckpt = {}
    for name, args in CALIBRATIONS.items():
        ckpt[name] = out / f"{model.name}-{name}"
        run(
            [
                *KVCALIB,
                "calibrate",
                str(model),
                "--dataset",
                str(calibration),
                "-o",
                str(ckpt[name]),
                *args,
                "--attention-scales",
                "--num-samples",
                "128",
                "--max-seq-len",
                "512",
                "--overwrite",
                "--quiet",
            ]
        )
    evals = [
        ("trn2", ckpt["trn2"], []),
        ("gpu", ckpt["gpu"], ["--compare", str(ckpt["gpu-head"])]),
        ("trn3", ckpt["trn3"], []),
    ]
    found = []
    for target, first, more in evals:
        result = json.loads(
            run(
                [
                    *KVCALIB,
                    "eval",
                    str(first),
                    "--dataset",
                    str(held_out),
                    "--target",
                    target,
                    "--num-samples",
                    "32",
                    "--fp8-attention",
                    *more,
                    "--json",
                    "--quiet",
                ]
            )
        )
        baseline = result["baseline"]
        for r in result["runs"]:
            found.append(
                (target, {**r, "baseline_ppl": baseline["ppl"], "tokens": result["num_tokens"]})
            )
    return found


def table(title: str, found: list[tuple[str, dict]]) -> str:
    lines = [
        f"### {title} ({found[0][1]['tokens']:,} tokens, unquantised PPL {found[0][1]['baseline_ppl']:.3f})",
        "",
        "| target | kind | ΔNLL | PPL | KL | top-1 | K clipped | worst K SQNR | worst Q SQNR |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for target, r in found:
        k = min(layer["k_sqnr_db"] for layer in r["layers"])
        q = [layer["q_sqnr_db"] for layer in r["layers"] if "q_sqnr_db" in layer]
        clipped = sum(layer["k_clipped"] for layer in r["layers"]) / len(r["layers"])
        lines.append(
            f"| {target} | {r['kind']} | {r['delta_nll']:+.4f} | {r['ppl']:.3f} | {r['kl']:.4f} | "
            f"{r['top1']:.2%} | {clipped:.2%} | {k:.1f} dB | {f'{min(q):.1f} dB' if q else '-'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "strategies")
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help="F (every K x F) or F@H (KV head H only); repeatable; default: 16",
    )
    parser.add_argument("--no-base", action="store_true", help="the variants only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(provenance(), flush=True)
    calibration = dataset(REPO / ".cache" / "fortunes.jsonl", "fortunes")
    held_out = dataset(REPO / ".cache" / "tutorial.jsonl", "python-tutorial")
    models = [] if args.no_base else [args.model]
    for spec in args.variant or ["16"]:
        factor, _, head = spec.partition("@")
        outlier = args.out / (
            f"{args.model.name}-outlier{factor}" + (f"-head{head}" if head else "")
        )
        if not (outlier / "config.json").exists():
            run(
                [
                    sys.executable,
                    str(REPO / "scripts" / "make_outlier_model.py"),
                    str(args.model),
                    str(outlier),
                    "--factor",
                    factor,
                    *(["--head", head] if head else []),
                ]
            )
        models.append(outlier)
    for model in models:
        print(table(model.name, rows(model, args.out, calibration, held_out)), flush=True)
        print()


if __name__ == "__main__":
    main()
