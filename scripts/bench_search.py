#!/usr/bin/env python3
"""The scale objective's search as a share of the whole calibration, three ways, on the same samples in one process.

One `kvcalib.calibrate` run (the CLI's defaults but for the sizes given) with its search
wrapped so that, on the same attention samples, three searches run in turn:

  unpruned  every candidate scored on every sample (objective.sample_terms, sum_terms, choose: the public pieces)
  kvcalib   kvcalib.calibration.objective.search: the same, but a candidate is scored no further once its error so
            far reaches absmax's whole error (the pruning), with fp8.fake_quantize's real cast
  tuned     the search kvcalib had until --tuned-from (git): the pruning, plus reused buffers (Workspace), a
            bit-trick E4M3 rounding (round_to_e4m3_), the reference attention kept across numerics and the clamp
            skipped where no value reaches the FP8 max (Reference); loaded from that commit's files

Each search runs --reps times, in turn, and its fastest time counts. The rest of the run (model load, observing,
writing) is the calibration's seconds less every search. Printed: each search's seconds and its share of the run
it would be part of (search / (rest + search)), and whether all three chose the same scales. With --extrapolate N
the rest is scaled to N samples of the same length (the search's samples are whole batches up to
kvcalib.hf.samples.SAMPLE_TOKENS: the same at any N; model load and writing scaled too, so the shares printed
are a little low), labelled as such. Timing is for reading: nothing is asserted.

    python scripts/bench_search.py [--model DIR] [--dataset FILE] [--num-samples 16] [--max-seq-len 2048]
        [--target trn2] [--reps 1] [--extrapolate 32] [--tuned-from 4ee64d5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = os.environ.get("KVCALIB_SMOLLM2") or str(REPO / ".cache" / "smollm2")
TUNED_FROM = "4ee64d5"  # the last commit with the tuned search


def load_tuned(rev: str, folder: Path) -> types.ModuleType:
    """objective.py at `rev`, with that commit's fp8.py and samples.py under it (its imports rewritten), from
    copies written to `folder` (imported from there, under other names)."""
    import importlib

    files = {
        "tuned_fp8": ("kvcalib/core/fp8.py", {}),
        "tuned_samples": ("kvcalib/hf/samples.py", {}),
        "tuned_objective": (
            "kvcalib/calibrate/objective.py",
            {
                "from kvcalib.core import fp8": "import tuned_fp8 as fp8",
                "from kvcalib.hf.samples import": "from tuned_samples import",
            },
        ),
    }
    for name, (path, replace) in files.items():
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for old, new in replace.items():
            source = source.replace(old, new)
        (folder / f"{name}.py").write_text(source)
    sys.path.insert(0, str(folder))
    return importlib.import_module("tuned_objective")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--dataset", help="JSON lines with a `text` column (default: fortunes, ~10k chars a row)"
    )
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--target", default="trn2")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--extrapolate",
        type=int,
        default=32,
        help="also print the shares at this many samples (the default's)",
    )
    parser.add_argument("--tuned-from", default=TUNED_FROM)
    args = parser.parse_args()
    print(provenance(), flush=True)

    import kvcalib

    # internal: this times the search itself, swapped in where the pipeline calls it, and its pieces
    from kvcalib.calibration import objective, pipeline

    with tempfile.TemporaryDirectory() as tmp:
        tuned = load_tuned(args.tuned_from, Path(tmp))
        kept = pipeline.search
        seconds: dict[str, list[float]] = {"unpruned": [], "kvcalib": [], "tuned": []}
        picks: dict[str, list] = {}

        def unpruned(samples, k_heads, v_heads, target, per_head):
            numerics, chosen = objective.scored_numerics(target, per_head), []
            for i, layer in enumerate(samples):
                k, v = (
                    objective.candidates(h[i], target, per_head, layer[0].key.shape[0])
                    for h in (k_heads, v_heads)
                )
                pairs = [
                    objective.sample_terms(s, [(k.on(n), v.on(n)) for n in numerics], numerics)
                    for s in layer
                ]
                terms, norms = (
                    objective.sum_terms([t for t, _ in pairs]),
                    objective.sum_terms([n for _, n in pairs]),
                )
                chosen.append(
                    tuple(
                        objective.choose(terms[:, kind], norms, c, per_head, numerics)
                        for kind, c in enumerate((k, v))
                    )
                )
            return chosen

        def three(samples, k_heads, v_heads, target, per_head, gather=lambda local: local):
            runs = {
                "unpruned": lambda: unpruned(samples, k_heads, v_heads, target, per_head),
                "kvcalib": lambda: kept(samples, k_heads, v_heads, target, per_head, gather),
                "tuned": lambda: tuned.search(
                    samples, k_heads, v_heads, tuned.fp8.get_target(target.name), per_head, gather
                ),
            }
            for _ in range(args.reps):
                for name, run in runs.items():
                    started = time.perf_counter()
                    chosen = run()
                    seconds[name].append(time.perf_counter() - started)
                    picks[name] = [
                        (c.choice.label, c.index, c.choice.clipped)
                        for layer in chosen
                        for c in layer[:2]
                    ]
                    if name == "kvcalib":
                        result = chosen
            return result

        pipeline.search = three
        dataset = args.dataset or _fortunes(Path(tmp) / "fortunes.jsonl", args.num_samples)
        run = kvcalib.calibrate(
            args.model,
            dataset,
            Path(tmp) / "out",
            target=args.target,
            num_samples=args.num_samples,
            max_seq_len=args.max_seq_len,
        )
    rest = run.seconds - sum(sum(times) for times in seconds.values())
    best = {name: min(times) for name, times in seconds.items()}
    print(
        f"model {args.model}, {args.num_samples} samples x {args.max_seq_len} tokens, target {args.target}, "
        f"OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}; load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"the run without any search: {rest:.1f} s; searches, fastest of {args.reps}: "
        + ", ".join(f"{name} {s:.1f} s" for name, s in best.items())
    )
    print(f"same choices: {picks['unpruned'] == picks['kvcalib'] == picks['tuned']}")
    rows = [("measured", rest)]
    if (
        args.extrapolate > args.num_samples
    ):  # the forward grows with the samples, the search does not
        rows.append(
            (
                f"extrapolated to {args.extrapolate} samples",
                rest * args.extrapolate / args.num_samples,
            )
        )
    print(f"{'share of the run':32} " + " ".join(f"{name:>10}" for name in best))
    for label, without in rows:
        print(f"{label:32} " + " ".join(f"{s / (without + s):10.2%}" for s in best.values()))


def _fortunes(path: Path, rows: int) -> str:
    """Debian's fortunes joined into rows of ~10,000 characters (over 2048 tokens each)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_text_dataset

    texts = make_text_dataset.join_entries(make_text_dataset.fortune_entries(), 10_000, rows)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


if __name__ == "__main__":
    main()
