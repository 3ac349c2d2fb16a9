#!/usr/bin/env python3
"""Issue 42's table: the default scale objective (output: the attention objective, then the whole-model step)
against the best of the alternatives, on held-out text, per model and chip numerics.

For each model and target (trn2, gpu): calibrate on fortunes three ways, the default (`scale_objective="output"`),
`"attention"` and `"absmax"` (absmax/FP8_MAX of the target), and for trn2 also absmax/448 (llm-compressor's rule:
the gpu absmax checkpoint, reused); then `evaluate` the default's checkpoint on Python tutorial paragraphs (held
out: not the calibration data) in the target's numerics and server order, with every other scale set and `unit`
(1.0) as `compare`. One markdown row per model and target: ΔNLL [95 % interval] of each scale set, the default
minus the best alternative (paired over the same rows: the baseline cancels), the verdict, and the default's
whole-model step (CalibrationResult.output_step). The compute path is the default one (`bf16_compute="auto"`, on
the CPU read from /proc/cpuinfo as the CLI reads it), recorded at the end of the header line.

A model named `constant-k` is SmolLM2 with near-constant outlier K channels (scripts/make_constant_k_model.py,
built from --smollm2 on the calibration data, 16 x 256 tokens, as tests/e2e/test_scale_objective.py builds it).

    OMP_NUM_THREADS=1 python scripts/output_step_table.py [constant-k] [MODEL_DIR ...] [--targets trn2,gpu]
        [--calib 32x512] [--held-out 16x512] [--data /work/exp/fortunes.jsonl] [--out out/output_step]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))

import make_constant_k_model  # noqa: E402  (this folder is on sys.path when run as a script)
import make_text_dataset  # noqa: E402
from provenance import REPO, provenance  # noqa: E402

from kvcalib.calibration.options import CalibrateOptions  # noqa: E402
from kvcalib.calibration.pipeline import calibrate  # noqa: E402
from kvcalib.core import fp8  # noqa: E402
from kvcalib.core.cpu import HostCpu  # noqa: E402
from kvcalib.evaluation.pipeline import EvalOptions, RunResult, evaluate  # noqa: E402
from kvcalib.evaluation.significance import Interval, paired_bootstrap  # noqa: E402
from kvcalib.hf.data import load_calibration_data  # noqa: E402
from kvcalib.hf.model import load_tokenizer  # noqa: E402

TARGETS = ("trn2", "gpu")
CONSTANT_K = "constant-k"
FIXTURE = dict(num_samples=16, max_seq_len=256)
COLUMNS = ("default", "attention", "absmax/FP8_MAX", "absmax/448", "1.0")


def size(text: str) -> tuple[int, int]:
    n, _, length = text.partition("x")
    return int(n), int(length)


def held_out_text(out: Path, rows: int) -> Path:
    """Python tutorial paragraphs joined into ~2,000-character rows, as tests/e2e/test_scale_objective.py."""
    path = out / f"tutorial-{rows}.jsonl"
    if not path.exists():
        paragraphs = make_text_dataset.join_entries(
            make_text_dataset.tutorial_paragraphs(), 2000, rows
        )
        path.write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in paragraphs), encoding="utf-8"
        )
    return path


def constant_k(smollm2: Path, out: Path, calibration: Path) -> Path:
    fixture = out / "smollm2-constant-k"
    if not (fixture / "config.json").exists():
        make_constant_k_model.make(smollm2, fixture, str(calibration), **FIXTURE)
    return fixture


def calibrated(model: Path, calibration: Path, ckpt: Path, opts: CalibrateOptions) -> dict:
    """calibrate's result as a dict, cached beside the checkpoint (a rerun reuses both)."""
    record = ckpt.parent / (ckpt.name + ".json")
    if record.exists() and (ckpt / "config.json").exists():
        return json.loads(record.read_text())
    result = calibrate(model, str(calibration), ckpt, opts).to_dict()
    record.write_text(json.dumps(result, indent=1))
    return result


def calibrations(
    model: Path,
    name: str,
    calibration: Path,
    out: Path,
    calib: tuple[int, int],
    targets: tuple[str, ...],
) -> dict[str, tuple[Path, dict]]:
    """ "{objective}-{target}" -> (checkpoint, its CalibrationResult dict); absmax-gpu is absmax/448 for trn2."""
    plans = {
        f"{objective}-{target}": (target, objective)
        for target in targets
        for objective in ("output", "attention", "absmax")
    }
    if "trn2" in targets:
        plans["absmax-gpu"] = ("gpu", "absmax")
    found = {}
    for key, (target, objective) in plans.items():
        ckpt = out / f"{name}-{key}"
        opts = CalibrateOptions(
            target=target,
            scale_objective=objective,
            num_samples=calib[0],
            max_seq_len=calib[1],
            overwrite=True,
            cpu=HostCpu.detect(),
        )
        print(f"  calibrate {name} {key}", file=sys.stderr, flush=True)
        found[key] = ckpt, calibrated(model, calibration, ckpt, opts)
    return found


def row_tokens(model: Path, held_out: Path, opts: EvalOptions, order: str) -> list[int]:
    """Tokens each eval row scores, in evaluate's order (its rows, right-padded: n real tokens score n - 1, or in
    the Neuron order the decode half, n // 2 - 1): to split a run's token_nll back into rows."""
    data = load_calibration_data(
        str(held_out),
        load_tokenizer(model, opts.trust_remote_code),
        split=opts.split,
        text_column=opts.text_column,
        num_samples=opts.num_samples,
        max_seq_len=opts.max_seq_len,
        seed=opts.seed,
        add_special_tokens=opts.add_special_tokens,
    )
    return [len(s) // 2 - 1 if order == fp8.NEURON_ORDER else len(s) - 1 for s in data.sequences]


def paired(mine: RunResult, theirs: RunResult, tokens: list[int]) -> Interval | None:
    """mine - theirs in ΔNLL per token, paired over the same rows (the unquantised baseline cancels)."""
    if mine.token_nll is None or theirs.token_nll is None or sum(tokens) != mine.token_nll.numel():
        raise SystemExit(
            f"cannot split {mine.token_nll and mine.token_nll.numel()} scored tokens into rows of "
            f"{sum(tokens)}: evaluate's rows changed"
        )
    diffs = [float(d.sum()) for d in (mine.token_nll - theirs.token_nll).split(tokens)]
    return paired_bootstrap(diffs, tokens)


def measure(
    model: Path,
    ckpts: dict[str, tuple[Path, dict]],
    target: str,
    held_out: Path,
    rows: tuple[int, int],
) -> dict:
    """One table row: eval of the default with every alternative compared, on the held-out text."""
    names = {
        "attention": ckpts[f"attention-{target}"][0],
        "absmax/FP8_MAX": ckpts[f"absmax-{target}"][0],
        "1.0": "unit",
    }
    if target == "trn2":
        names["absmax/448"] = ckpts["absmax-gpu"][0]
    opts = EvalOptions(
        target=target,
        num_samples=rows[0],
        max_seq_len=rows[1],
        compare=tuple(str(p) for p in names.values()),
        layer_rows=0,
        cpu=HostCpu.detect(),
    )
    print(f"  eval {model.name} {target}", file=sys.stderr, flush=True)
    result = evaluate(ckpts[f"output-{target}"][0], str(held_out), opts)
    runs = dict(zip(["default", *names], result.runs))
    best = min((n for n in runs if n != "default"), key=lambda n: runs[n].delta_nll)
    gap = paired(runs["default"], runs[best], row_tokens(model, held_out, opts, result.order))
    default = ckpts[f"output-{target}"][1]
    return {
        "target": target,
        "order": result.order,
        "compute": result.compute,
        "tokens": result.num_tokens,
        "rows": result.num_samples,
        "baseline_nll": result.baseline_nll,
        "seconds": round(result.seconds, 1),
        "runs": {
            n: {
                "delta_nll": r.delta_nll,
                "interval": r.delta_nll_interval and r.delta_nll_interval.to_dict(),
            }
            for n, r in runs.items()
        },
        "best": best,
        "gap": gap and gap.to_dict(),
        "calibration_compute": default["compute"],
        "output_step": default["output_step"],
        "changed": changed_layers(default, ckpts[f"attention-{target}"][1]),
    }


def changed_layers(default: dict, attention: dict) -> list[dict]:
    """The layer-kinds whose scale the whole-model step moved off the attention objective's choice (the attention
    calibration's label, same data and numerics), with the step's record (choice["output"]: label -> mean KL)."""
    out = []
    for mine, theirs in zip(default["layers"], attention["layers"]):
        for kind in ("k", "v"):
            choice, before = mine[kind].get("choice") or {}, theirs[kind].get("choice") or {}
            if choice.get("label") != before.get("label"):
                out.append(
                    {
                        "layer": mine["layer"],
                        "kind": kind,
                        "from": before.get("label"),
                        "to": choice.get("label"),
                        "scale": mine[kind]["scale"],
                        "attention_scale": theirs[kind]["scale"],
                        "output": choice.get("output"),
                    }
                )
    return out


def cell(run: dict) -> str:
    i = run["interval"]
    return f"{run['delta_nll']:+.4f}" + (
        "" if i is None else f" [{i['low']:+.4f}, {i['high']:+.4f}]"
    )


def verdict(row: dict) -> str:
    """worse: the paired difference default - best alternative excludes 0 upward; (disjoint: the two ΔNLL
    intervals do not even overlap)."""
    gap, mine, theirs = (
        row["gap"],
        row["runs"]["default"]["interval"],
        row["runs"][row["best"]]["interval"],
    )
    disjoint = mine is not None and theirs is not None and mine["low"] > theirs["high"]
    if gap is None:
        return "no interval"
    word = "worse" if gap["low"] > 0 else "better" if gap["high"] < 0 else "no worse"
    return word + (" (intervals disjoint)" if disjoint else "")


def step(record: dict | None) -> str:
    if not record:
        return "-"
    if record.get("skipped"):
        return f"skipped: {record['skipped']}"
    return (
        f"{record['material']}/{record['weighed']}/{record['changed']}/{record['forwards']} "
        f"({record['rows']} rows)"
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| model | target | order | tokens | "
        + " | ".join(COLUMNS)
        + " | default - best (paired) | verdict | "
        "step: material/weighed/changed/forwards |",
        "|---|---|---|---:|" + "---:|" * len(COLUMNS) + "---:|---|---|",
    ]
    for row in rows:
        cells = [cell(row["runs"][c]) if c in row["runs"] else "(= FP8_MAX)" for c in COLUMNS]
        gap = row["gap"]
        gap_cell = (
            "-"
            if gap is None
            else f"{gap['estimate']:+.4f} [{gap['low']:+.4f}, {gap['high']:+.4f}]"
        )
        lines.append(
            f"| {row['model']} | {row['target']} | {row['order']} | {row['tokens']:,} | "
            + " | ".join(cells)
            + f" | {gap_cell} vs {row['best']} | {verdict(row)} | "
            f"{step(row['output_step'])} |"
        )
    return "\n".join(lines)


def changes(rows: list[dict]) -> str:
    """Per row, what the whole-model step changed: layer, kind, the attention objective's pick -> the step's, and
    the mean next-token KL of each candidate it weighed."""
    lines = []
    for row in rows:
        moved = "; ".join(
            f"layer {c['layer']} {c['kind'].upper()} {c['from']} -> {c['to']} (KL "
            + ", ".join(f"{label} {kl:.2e}" for label, kl in (c["output"] or {}).items())
            + ")"
            for c in row["changed"]
        )
        lines.append(f"- {row['model']} {row['target']}: {moved or 'no layer changed'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help=f"model directories, or {CONSTANT_K}")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument(
        "--calib", type=size, default=(32, 512), help="calibration samples x tokens"
    )
    parser.add_argument(
        "--held-out", type=size, default=(16, 512), help="held-out samples x tokens"
    )
    parser.add_argument(
        "--data", type=Path, required=True, help="calibration data (a jsonl with a text column)"
    )
    parser.add_argument(
        "--smollm2",
        type=Path,
        default=Path(os.environ.get("KVCALIB_SMOLLM2") or REPO / ".cache" / "smollm2"),
        help="the constant-K fixture's base",
    )
    parser.add_argument("--out", type=Path, default=REPO / "out" / "output_step")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    header = provenance()
    print(header, flush=True)
    targets = tuple(args.targets.split(","))
    held_out = held_out_text(args.out, args.held_out[0])
    rows = []
    for model in args.models:
        name = CONSTANT_K if model == CONSTANT_K else Path(model).name
        path = constant_k(args.smollm2, args.out, args.data) if model == CONSTANT_K else Path(model)
        ckpts = calibrations(path, name, args.data, args.out, args.calib, targets)
        for target in targets:
            rows.append({"model": name, **measure(path, ckpts, target, held_out, args.held_out)})
            (args.out / f"{name}-{target}.row.json").write_text(json.dumps(rows[-1], indent=1))
            print(table(rows[-1:]) + "\n" + changes(rows[-1:]), flush=True)
    paths = sorted({p for row in rows for p in (row["calibration_compute"], row["compute"])})
    header += "; compute: " + " / ".join(paths)
    text = f"{header}\n\n{table(rows)}\n\nWhat the whole-model step changed:\n\n{changes(rows)}\n"
    (args.out / "table.md").write_text(text)
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
