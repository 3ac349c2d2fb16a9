#!/usr/bin/env python3
"""Scale-out benchmark: peak RSS streamed vs in memory, and throughput of 1 vs 2 processes.

1. Peak RSS. Builds a synthetic bf16 Llama of a few GB (random weights, one shard per layer;
   by default hidden 2048, 24 layers: 2.9 GiB) in a temporary directory, calibrates it once
   with the in-memory engine and once with `--stream-layers`-equivalent engine "stream",
   each in a fresh process, and reads each process's peak resident set size (VmHWM) at the
   end. Target: streamed <= 0.3x in memory. The two runs' scales must be equal bit for bit.
2. Throughput. A smaller synthetic model (default hidden 1024, 8 layers: 0.24 GiB);
   `kvcalib calibrate` in one process and under `torchrun --nproc-per-node 2`, every
   process with one thread (OMP_NUM_THREADS=1), alternating, --reps times each. Reports the
   calibration throughput (tokens / observe time, the slowest rank's for two processes) and
   the wall time of the whole command. Target: 2 processes >= 1.7x one. Scales must be equal.

Everything is removed afterwards unless --keep. Nothing is asserted: numbers are for reading;
on a shared machine run it more than once.

    python scripts/bench_scale.py [--reps 3] [--rss-hidden 2048 --rss-layers 24] [--tp-hidden 1024 --tp-layers 8]
        [--skip-rss|throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30

CHILD = """
import json, resource, sys
import kvcalib
engine, model, data, out, samples, seq_len = sys.argv[1:7]
more = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
r = kvcalib.calibrate(model, data, out, engine=engine, num_samples=int(samples), max_seq_len=int(seq_len),
                      batch_size=4, **more)
peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB, the VmHWM
print(json.dumps({"peak_rss": peak_rss, "tokens_per_s": r.tokens_per_s, "seconds": r.seconds,
                  "objective_seconds": r.objective_seconds, "warnings": r.warnings,
                  "absmax": [[l.k.absmax, l.v.absmax] for l in r.layers],
                  "scales": [[l.k.scale, l.v.scale] for l in r.layers]}))
"""


def env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )


def build(root: Path, name: str, hidden: int, layers: int) -> tuple[Path, int]:
    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from helpers import build_tokenizer
    from make_synthetic_llama import build_synthetic_llama

    path = root / name
    size = build_synthetic_llama(
        path,
        build_tokenizer(),
        hidden=hidden,
        intermediate=4 * hidden,
        layers=layers,
        heads=hidden // 128,
        kv_heads=max(1, hidden // 256),
    )
    return path, size


def write_dataset(path: Path, rows: int) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from helpers import fortune_texts, write_jsonl

    return write_jsonl(path, [{"text": t} for t in fortune_texts(rows, chars=2000)])


def run_child(
    engine: str, model: Path, data: Path, out: Path, samples: int, seq_len: int, **more: object
) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            engine,
            str(model),
            str(data),
            str(out),
            str(samples),
            str(seq_len),
            json.dumps(more),
        ],
        capture_output=True,
        text=True,
        env=env(),
    )
    if proc.returncode != 0:
        sys.exit(f"{engine} run failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cli(processes: int, model: Path, data: Path, out: Path, samples: int, seq_len: int) -> dict:
    launcher = (
        [sys.executable, "-m", "kvcalib"]
        if processes == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={processes}",
            "-m",
            "kvcalib",
        ]
    )
    args = [
        "calibrate",
        str(model),
        "--dataset",
        str(data),
        "-o",
        str(out),
        "--num-samples",
        str(samples),
        "--max-seq-len",
        str(seq_len),
        "--batch-size",
        "4",
        "--json",
    ]
    cpu_before = _children_cpu()
    started = time.perf_counter()
    proc = subprocess.run([*launcher, *args], capture_output=True, text=True, env=env())
    wall = time.perf_counter() - started
    cpu = _children_cpu() - cpu_before
    if proc.returncode != 0:
        sys.exit(f"{processes}-process run failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    result = json.loads(proc.stdout)
    return {
        "tokens_per_s": result["tokens_per_s"],
        "wall": wall,
        "cpu": cpu,
        "tokens": result["num_tokens"],
        "absmax": [[layer["k"]["absmax"], layer["v"]["absmax"]] for layer in result["layers"]],
    }


def _children_cpu() -> float:
    """CPU seconds (user + system) of every finished child, grandchildren (torchrun's workers) included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def balance_bound(
    model: Path, data: Path, samples: int, seq_len: int, batch_size: int = 4
) -> float:
    """The speedup 2 processes could reach on 2 free cores: padded tokens in all / on the busiest rank."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO))
    # internal: how calibrate splits the batches between ranks, which no public function returns
    from kvcalib.calibration.distributed import batch_shares
    from kvcalib.calibration.options import CalibrateOptions
    from kvcalib.hf.data import load_calibration_data

    opts = CalibrateOptions(num_samples=samples, max_seq_len=seq_len)
    seqs = load_calibration_data(str(data), AutoTokenizer.from_pretrained(model), opts).sequences
    shares = batch_shares(seqs, batch_size, 2)

    def padded(share: tuple[tuple[int, ...], ...]) -> int:
        return sum(
            len(share[i]) * len(share[i : i + batch_size]) for i in range(0, len(share), batch_size)
        )

    return padded(tuple(sorted(seqs, key=len, reverse=True))) / max(padded(s) for s in shares)


def bench_rss(root: Path, data: Path, args: argparse.Namespace) -> None:
    model, size = build(root, "rss-model", args.rss_hidden, args.rss_layers)
    print(
        f"peak RSS: synthetic Llama, hidden {args.rss_hidden}, {args.rss_layers} layers, {size / GiB:.2f} GiB bf16; "
        f"{args.rss_samples} samples x {args.rss_seq_len} tokens",
        flush=True,
    )
    rows = {
        engine: [
            run_child(
                engine, model, data, root / f"out-{engine}", args.rss_samples, args.rss_seq_len
            )
            for _ in range(args.rss_reps)
        ]
        for engine in ("native", "stream")
    }
    peak = {engine: max(r["peak_rss"] for r in runs) for engine, runs in rows.items()}
    for engine, runs in rows.items():
        each = ", ".join(f"{r['peak_rss'] / GiB:.2f}" for r in runs)
        print(
            f"  {engine:7s} peak RSS {peak[engine] / GiB:6.2f} GiB   (runs: {each}; {runs[0]['seconds']:.1f} s)"
        )
    print(f"  streamed / in memory = {peak['stream'] / peak['native']:.2f}x  (target <= 0.3x)")
    same = all(r["absmax"] == rows["native"][0]["absmax"] for runs in rows.values() for r in runs)
    print(f"  scales equal across engines and runs: {same}", flush=True)
    shutil.rmtree(model, ignore_errors=True)


def bench_throughput(root: Path, data: Path, args: argparse.Namespace) -> None:
    model, size = build(root, "tp-model", args.tp_hidden, args.tp_layers)
    print(
        f"throughput: synthetic Llama, hidden {args.tp_hidden}, {args.tp_layers} layers, {size / GiB:.2f} GiB bf16; "
        f"{args.tp_samples} samples x {args.tp_seq_len} tokens, batch 4, OMP_NUM_THREADS=1 per process",
        flush=True,
    )
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for rep in range(args.reps):
        for processes in (1, 2):
            r = run_cli(
                processes, model, data, root / f"out-{processes}", args.tp_samples, args.tp_seq_len
            )
            runs[processes].append(r)
            print(
                f"  rep {rep + 1}: {processes} process(es): {r['tokens_per_s']:8.1f} tok/s calibrating, "
                f"{r['wall']:6.1f} s wall",
                flush=True,
            )
    med = {p: statistics.median(r["tokens_per_s"] for r in rs) for p, rs in runs.items()}
    wall = {p: statistics.median(r["wall"] for r in rs) for p, rs in runs.items()}
    cpu = {p: statistics.median(r["cpu"] for r in rs) for p, rs in runs.items()}
    print(
        f"  median tok/s: 1 process {med[1]:.1f}, 2 processes {med[2]:.1f} -> {med[2] / med[1]:.2f}x "
        "(target >= 1.7x)"
    )
    print(
        f"  median wall:  1 process {wall[1]:.1f} s, 2 processes {wall[2]:.1f} s -> {wall[1] / wall[2]:.2f}x"
    )
    print(
        f"  median CPU seconds of the whole command: 1 process {cpu[1]:.1f}, 2 processes {cpu[2]:.1f}; "
        f"cores it got on average (CPU s / wall s): {cpu[1] / wall[1]:.2f} and {cpu[2] / wall[2]:.2f}"
    )
    bound = balance_bound(model, data, args.tp_samples, args.tp_seq_len)
    print(
        f"  work balance: 2 processes could reach {bound:.2f}x on 2 free cores (padded tokens, busiest rank)"
    )
    same = all(r["absmax"] == runs[1][0]["absmax"] for rs in runs.values() for r in rs)
    print(
        f"  scales equal for 1 and 2 processes, every run: {same}; cores: {os.cpu_count()}, "
        f"load average before: {args.load_before}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3, help="throughput runs of each kind")
    parser.add_argument("--rss-reps", type=int, default=1)
    parser.add_argument("--rss-hidden", type=int, default=2048)
    parser.add_argument("--rss-layers", type=int, default=24)
    parser.add_argument("--rss-samples", type=int, default=8)
    parser.add_argument("--rss-seq-len", type=int, default=64)
    parser.add_argument("--tp-hidden", type=int, default=1024)
    parser.add_argument("--tp-layers", type=int, default=8)
    parser.add_argument("--tp-samples", type=int, default=128)
    parser.add_argument("--tp-seq-len", type=int, default=256)
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    print(provenance(), flush=True)
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    root = Path(tempfile.mkdtemp(prefix="kvcalib-bench-scale-"))
    try:
        rows = max(args.rss_samples, args.tp_samples)
        data = write_dataset(root / "fortunes.jsonl", rows)
        if not args.skip_rss:
            bench_rss(root, data, args)
        if not args.skip_throughput:
            bench_throughput(root, data, args)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
