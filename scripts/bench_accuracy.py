#!/usr/bin/env python3
"""What FP8 KV costs on the benchmarks users decide by: real models x chip numerics x scales, with paired intervals.

For each model: calibrate on fortunes for trn2 and for gpu (kvcalib's default objective), and
absmax/448 as llm-compressor writes it (`--target gpu --scale-objective absmax`). Then, under trn2
and under gpu numerics, the unquantised cache against kvcalib's scales for that chip, all 1.0 and
absmax/448:
- ΔNLL on held-out text (the Python tutorial) with its paired bootstrap interval over sequences
  (`kvcalib eval`);
- lm-eval's own LAMBADA (acc), HellaSwag (acc_norm) and ARC-Easy (acc), the first `--limit` items
  of each, on offline data (scripts/prepare_tasks.py), each run paired with the baseline item by
  item (`kvcalib eval-tasks`), baseline once per model.
Prints one markdown table, with the item and token counts. Nothing is asserted.

    python scripts/bench_accuracy.py [MODEL ...] [--limit 30] [--calib 16x256] [--held-out 16x256]
            [--task-data .cache/tasks] [--out out/accuracy] [--bf16-compute float32]

Defaults: SmolLM2-135M, Gemma-3-270M and Qwen2.5-Coder-0.5B as scripts/prepare_model.py lays them out
under .cache (the task data: scripts/prepare_tasks.py .cache/tasks); 30 items per task (about 270
loglikelihood requests per run, 7 runs per model); bf16 through float32 matmuls. At these defaults the three
models take 46 minutes on 2 cores (measured: SmolLM2-135M 477 s, Gemma-3-270M 802 s, Qwen2.5-Coder-0.5B
1,475 s, OMP_NUM_THREADS=2, one at a time); `--limit` buys narrower intervals for time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TASKS = (
    ("lambada_openai", "acc", "LAMBADA acc"),
    ("hellaswag", "acc_norm", "HellaSwag acc_norm"),
    ("arc_easy", "acc", "ARC-Easy acc"),
)
SCALES = (("kvcalib", "default-{target}"), ("1.0", "unit"), ("absmax/448", "absmax-448"))
TARGETS = ("trn2", "gpu")


def size(text: str) -> tuple[int, int]:
    n, _, length = text.partition("x")
    return int(n), int(length)


def calibrations(
    model: Path, out: Path, data: str, calib: tuple[int, int], compute: str
) -> dict[str, Path]:
    import kvcalib

    plans = {
        "default-trn2": dict(target="trn2"),
        "default-gpu": dict(target="gpu"),
        "absmax-448": dict(target="gpu", scale_objective="absmax"),
    }
    found = {}
    for name, options in plans.items():
        found[name] = out / f"{model.name}-{name}"
        if not (found[name] / "config.json").exists():
            kvcalib.calibrate(
                model,
                data,
                found[name],
                num_samples=calib[0],
                max_seq_len=calib[1],
                bf16_compute=compute,
                overwrite=True,
                **options,
            )
    return found


def scale_source(ckpts: dict[str, Path], pattern: str, target: str) -> str:
    return "unit" if pattern == "unit" else str(ckpts[pattern.format(target=target)])


def nll_rows(ckpts: dict[str, Path], held_out: str, size_: tuple[int, int], compute: str) -> dict:
    """(target, scales) -> (ΔNLL, its interval), and the token count."""
    import kvcalib

    rows, tokens = {}, 0
    for target in TARGETS:
        own = ckpts[f"default-{target}"]
        others = tuple(scale_source(ckpts, pattern, target) for _, pattern in SCALES[1:])
        result = kvcalib.evaluate(
            own,
            held_out,
            target=target,
            num_samples=size_[0],
            max_seq_len=size_[1],
            compare=others,
            layer_rows=0,
            bf16_compute=compute,
        )
        tokens = result.num_tokens
        for (label, _), run in zip(SCALES, result.runs):
            rows[target, label] = (run.delta_nll, run.delta_nll_interval)
    return {"rows": rows, "tokens": tokens}


def run_name(target: str, label: str) -> str:
    """trn2's own scales are the checkpoint evaluate_tasks runs anyway."""
    return "checkpoint" if (target, label) == ("trn2", "kvcalib") else f"{target} {label}"


def task_rows(ckpts: dict[str, Path], task_data: str, limit: int, compute: str) -> dict:
    """(target, scales) -> {task: (score, interval)}, and the baseline's scores and item counts."""
    import kvcalib

    runs = tuple(
        (run_name(target, label), scale_source(ckpts, pattern, target), target)
        for target in TARGETS
        for label, pattern in SCALES
        if run_name(target, label) != "checkpoint"
    )
    result = kvcalib.evaluate_tasks(
        ckpts["default-trn2"],
        [t for t, _, _ in TASKS],
        task_data=task_data,
        limit=limit,
        extra_runs=runs,
        bf16_compute=compute,
        batch_size=4,
    )
    wanted = {(task, metric) for task, metric, _ in TASKS}
    rows = {}
    baseline, items = {}, {}
    for row in result.rows:
        if (row.task, row.metric) not in wanted:
            continue
        baseline[row.task], items[row.task] = row.baseline, row.items
        for target in TARGETS:
            for label, _ in SCALES:
                name = run_name(target, label)
                rows.setdefault((target, label), {})[row.task] = (
                    row.scores[name],
                    row.intervals[name],
                )
    return {"rows": rows, "baseline": baseline, "items": items}


def fmt(value: float, interval) -> str:
    if interval is None:
        return f"{value:+.4f}"
    star = "**" if interval.significant else ""
    return f"{star}{value:+.3f}{star} [{interval.low:+.3f}, {interval.high:+.3f}]"


def table(name: str, nll: dict, tasks: dict) -> str:
    heads = " | ".join(h for _, _, h in TASKS)
    lines = [
        f"### {name}: ΔNLL on {nll['tokens']:,} held-out tokens; tasks on "
        + ", ".join(f"{t} {n}" for t, n in tasks["items"].items())
        + " items",
        "",
        f"| numerics | scales | ΔNLL [95%] | {heads} |",
        "|---|---|---:|" + "---:|" * len(TASKS),
        "| (none) | unquantised | 0 | "
        + " | ".join(f"{tasks['baseline'][t]:.3f}" for t, _, _ in TASKS)
        + " |",
    ]
    for target in TARGETS:
        for label, _ in SCALES:
            delta, interval = nll["rows"][target, label]
            cells = []
            for task, _, _ in TASKS:
                score, diff = tasks["rows"][target, label][task]
                cells.append(f"{score:.3f} ({fmt(score - tasks['baseline'][task], diff)})")
            lines.append(
                f"| {target} | {label} | {fmt(delta, interval)} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def main() -> None:
    import kvcalib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "models",
        type=Path,
        nargs="*",
        default=[
            REPO / ".cache" / "smollm2",
            REPO / ".cache" / "models" / "gemma3-270m",
            REPO / ".cache" / "models" / "qwen2.5-coder-0.5b",
        ],
    )
    parser.add_argument("--limit", type=int, default=30, help="items per task")
    parser.add_argument("--calib", type=size, default=(16, 256))
    parser.add_argument("--held-out", type=size, default=(16, 256))
    parser.add_argument("--task-data", default=str(REPO / ".cache" / "tasks"))
    parser.add_argument("--out", type=Path, default=REPO / "out" / "accuracy")
    parser.add_argument("--bf16-compute", default="float32", choices=["auto", "native", "float32"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calibration, held_out = REPO / ".cache" / "fortunes.jsonl", REPO / ".cache" / "tutorial.jsonl"
    for path in (calibration, held_out):
        if not path.exists():
            sys.exit(f"no {path}: python scripts/make_text_dataset.py {path.name} (see the README)")
    print(provenance(), flush=True)
    started = time.perf_counter()
    for model in args.models:
        began = time.perf_counter()
        ckpts = calibrations(model, args.out, str(calibration), args.calib, args.bf16_compute)
        nll = nll_rows(ckpts, str(held_out), args.held_out, args.bf16_compute)
        tasks = task_rows(ckpts, args.task_data, args.limit, args.bf16_compute)
        print(table(model.name, nll, tasks), flush=True)
        print(f"\n({time.perf_counter() - began:.0f} s)\n", flush=True)
        (args.out / f"{model.name}.json").write_text(
            json.dumps(
                {
                    "nll": {
                        f"{t} {s}": [d, kvcalib.to_json(i)]
                        for (t, s), (d, i) in nll["rows"].items()
                    },
                    "tokens": nll["tokens"],
                    "baseline": tasks["baseline"],
                    "items": tasks["items"],
                    "tasks": {
                        f"{t} {s}": {k: [v, kvcalib.to_json(i)] for k, (v, i) in r.items()}
                        for (t, s), r in tasks["rows"].items()
                    },
                },
                indent=1,
            )
        )
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
