#!/usr/bin/env python3
"""How many calibration tokens the scales need: real models calibrated for trn2 at growing token budgets, each
against the largest budget's scales.

Calibration text: long rows of the Python library reference (Debian's python3.11-doc, `_sources/library`), each
budget the first N rows of --row tokens. Held out: the Python tutorial (`_sources/tutorial`). Per model and budget:
- calibrate (kvcalib's defaults but the budget): wall time, of it observing and choosing the scales (the search);
- the scales against the largest budget's: the largest |log2| ratio of a K or V scale, and how many differ;
- ΔNLL against the unquantised cache in the Neuron order (`kvcalib eval`), and the paired interval over held-out
  rows of ΔNLL(budget) − ΔNLL(largest budget), on the same rows (rows of equal length: --held-out);
- clipping at --context tokens (`eval-context --lengths L --saturation-only`): the worst layer's K and V saturated
  fraction on the held-out tutorial packed to that length.
Prints one markdown table (with the command, commit, date and CPU). Nothing is asserted.

    python scripts/bench_tokens.py [MODEL ...] [--budgets 16k,64k,256k,1m] [--row 2048] [--held-out 16x1024]
            [--context 8192] [--out out/tokens] [--bf16-compute auto]

Defaults: SmolLM2-135M, Gemma-3-270M and Qwen2.5-Coder-0.5B as scripts/prepare_model.py lays them out under .cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from make_text_dataset import join_entries, tutorial_paragraphs
from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
MODELS = (".cache/smollm2", ".cache/models/gemma3-270m", ".cache/models/qwen2.5-coder-0.5b")


def tokens(text: str) -> int:
    text = text.lower()
    return (
        int(float(text[:-1]) * 1024 ** (1 + "km".index(text[-1])))
        if text[-1] in "km"
        else int(text)
    )


def write_rows(path: Path, directory: Path, chars: int, max_rows: int) -> Path:
    rows = join_entries(tutorial_paragraphs(directory), chars, max_rows)
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return path


def scales(result) -> dict[tuple[int, str], float]:
    return {
        (layer.layer, kind): getattr(layer, kind).scale for layer in result.layers for kind in "kv"
    }


def paired(mine, theirs, rows: int):
    """The interval over rows of mine − theirs: their per-token NLLs, rows of equal length."""
    from kvcalib.evaluation.significance import paired_bootstrap

    a, b = mine.token_nll.double(), theirs.token_nll.double()
    assert a.numel() % rows == 0, "held-out rows of equal length"
    per_row = (a - b).reshape(rows, -1).mean(dim=1)
    return paired_bootstrap(per_row.tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--budgets", default="16k,64k,256k,1m")
    parser.add_argument("--row", type=int, default=2048, help="calibration tokens per row")
    parser.add_argument("--held-out", default="16x1024", help="ROWSxTOKENS of held-out text")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("out/tokens"))
    parser.add_argument("--bf16-compute", default="auto")
    args = parser.parse_args()

    import kvcalib

    budgets = sorted(tokens(b) for b in args.budgets.split(","))
    held_rows, held_len = (int(x) for x in args.held_out.split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    rows_needed = budgets[-1] // args.row
    calib = write_rows(args.out / "library.jsonl", SOURCES / "library", 6 * args.row, rows_needed)
    held = write_rows(
        args.out / "tutorial.jsonl", SOURCES / "tutorial", 6 * held_len, 4 * held_rows
    )
    compute = dict(bf16_compute=args.bf16_compute)
    lines = [
        "| model | tokens | calibrate s | observe s | choose s | scales ≠ largest "
        "| max abs log2 ratio | ΔNLL | − largest's [95 %] | K / V clipped at "
        f"{args.context} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for model in args.models:
        name = Path(model).name
        results = {}
        for budget in reversed(budgets):  # the largest first: the others compare with it
            out = args.out / name / str(budget)
            started = time.perf_counter()
            results[budget] = kvcalib.calibrate(
                model,
                str(calib),
                out,
                target="trn2",
                num_samples=budget // args.row,
                max_seq_len=args.row,
                overwrite=True,
                **compute,
            )
            print(f"{name} {budget}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        largest = args.out / name / str(budgets[-1])
        for budget in budgets:
            result, out = results[budget], args.out / name / str(budget)
            mine, ref = scales(result), scales(results[budgets[-1]])
            differ = sum(mine[k] != ref[k] for k in mine)
            worst = max(abs(math.log2(mine[k] / ref[k])) for k in mine)
            ev = kvcalib.evaluate(
                out,
                str(held),
                target="trn2",
                num_samples=held_rows,
                max_seq_len=held_len,
                compare=[] if budget == budgets[-1] else [str(largest)],
                **compute,
            )
            run = ev.runs[0]
            interval = paired(run, ev.runs[1], held_rows) if len(ev.runs) > 1 else None
            context = kvcalib.evaluate_context(
                out, str(held), [args.context], nll=False, num_samples=1, **compute
            )
            row = context.rows[0]
            versus = (
                "-"
                if interval is None
                else f"{interval.estimate:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]"
            )
            lines.append(
                f"| {name} | {result.num_tokens:,} | {result.seconds:.0f} | {result.observe_seconds:.0f} "
                f"| {result.objective_seconds:.0f} | {differ} of {len(mine)} "
                f"| {worst:.3f} | {run.delta_nll:+.4f} "
                f"| {versus} "
                f"| {row.k_clipped:.2e} / {row.v_clipped:.2e} |"
            )
            print(lines[-1], file=sys.stderr)
    print(provenance())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
