#!/usr/bin/env python3
"""kvcalib calibrate against llm-compressor's oneshot and against a bare forward, side by side.

One run, three fresh processes in turn, on the same model, samples, dtype and threads:

  (a) kvcalib    `python -m kvcalib calibrate MODEL --dataset DATA -o OUT ...`, end to end
                 (imports, data, model load, observing, checkpoint write and validation)
  (b) oneshot    llm-compressor's `oneshot(model=MODEL, recipe=recipes/kv-fp8-trn2.yaml,
                 dataset=<the same token ids>, output_dir=OUT)`, end to end, as a user runs it
                 (its defaults: batch size 1, sequential pipeline; it saves the model)
  (d) absmax     (a) with --scale-objective absmax: a/d is what the scale objective costs (its search)
  (c) forward    the floor: a process that imports torch and transformers, reads the same
                 samples through the same selection, loads the model and runs one full
                 `AutoModelForCausalLM` forward (every layer and the LM head, no KV cache,
                 under inference_mode, on kvcalib's compute path: a bf16 model's matmuls in
                 float32 where the CPU has no native bf16) over the same right-padded batches
                 kvcalib uses, and writes nothing. A calibrator that runs the model cannot do less.

All three read the samples with kvcalib.hf.data.load_calibration_data (the first N rows,
shuffled with seed 42, truncated to --max-seq-len). Each process gets OMP_NUM_THREADS and
MKL_NUM_THREADS = --threads. Wall time is measured around the process; CPU time (user +
system) and peak RSS are the child's own rusage from wait4. With --reps, a, b and c take
turns and the medians are printed. Prints the ratios a/b (target <= 0.5), a/c (target
<= 0.85: the forward stops after the last layer's K/V, so the floor is about 0.8) and a/d (the scale objective's
search, target <= 1.3), and with --reps each run's own a/c and their median. On a shared
machine wall time swings with the other load, and CPU time with it where that load slows the core rather than
taking it (measured here: 31.7-37.5 s for the same (a) over five runs).
Timing is for reading: nothing is asserted.

    python scripts/bench_calibrate.py [--model DIR] [--dataset FILE] [--num-samples 64]
        [--max-seq-len 512] [--dtype auto] [--threads 1] [--batch-size 4] [--reps 1] [--skip-oneshot]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = os.environ.get("KVCALIB_SMOLLM2") or str(REPO / ".cache" / "smollm2")
RECIPE = REPO / "recipes" / "kv-fp8-trn2.yaml"


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds, peak RSS MiB, stdout) of one child process; exits on failure."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: ru_maxrss in KiB
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd[:5])} ... failed ({proc.returncode}):\n{err.read()[-4000:]}")
        return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out.read()


def require_model(model: str) -> None:
    if not (Path(model) / "config.json").exists():
        sys.exit(
            f"no model at {model}: run `python scripts/prepare_model.py smollm2-135m .cache/smollm2` "
            "or pass --model"
        )


def default_dataset(args: argparse.Namespace, work: Path) -> None:
    """Without --dataset: real prose from Debian's fortunes, one row per sample, written under `work`."""
    if args.dataset is None:
        args.dataset = str(work / "fortunes.jsonl")
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "make_text_dataset.py"),
                args.dataset,
                "--max-rows",
                str(args.num_samples),
            ],
            check=True,
            capture_output=True,
        )


def child_env(threads: int, **extra: str) -> dict[str, str]:
    """The environment every measured child gets: `threads` threads, this checkout importable, offline, quiet."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "TOKENIZERS_PARALLELISM": "false",
        "LLM_COMPRESSOR_LOG_DISABLED": "true",
        "TQDM_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        **extra,
    }


# --- the child processes (b) and (c) ------------------------------------------------------


def child_sequences(args: argparse.Namespace):
    from transformers import AutoTokenizer

    # internal: the baselines read the very token sequences calibrate reads
    from kvcalib.calibration.options import CalibrateOptions
    from kvcalib.hf.data import load_calibration_data

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    opts = CalibrateOptions(num_samples=args.num_samples, max_seq_len=args.max_seq_len)
    data = load_calibration_data(args.dataset, tokenizer, opts)
    return tokenizer, data


def child_oneshot(args: argparse.Namespace) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot

    _, data = child_sequences(args)
    sequences = [list(s) for s in data.sequences]
    dataset = Dataset.from_dict(
        {"input_ids": sequences, "attention_mask": [[1] * len(s) for s in sequences]}
    )
    oneshot(
        model=args.model,
        recipe=str(RECIPE),
        dataset=dataset,
        num_calibration_samples=len(sequences),
        max_seq_length=args.max_seq_len,
        precision=args.dtype,
        output_dir=args.out,
    )


def child_forward(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    # internal: the bare forward batches and computes as calibrate does, so only the observing differs
    from kvcalib.core.cpu import HostCpu, choose_compute
    from kvcalib.hf.compute import compute_path
    from kvcalib.hf.data import batches

    tokenizer, data = child_sequences(args)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    pad_id = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else (tokenizer.eos_token_id or 0)
    )
    # kvcalib's compute path (a bf16 model's matmuls in float32 on CPUs without native bf16), so that (a) and (c)
    # differ only in what kvcalib adds
    path = choose_compute("auto", model.dtype, torch.device("cpu"), HostCpu.detect())
    with torch.inference_mode(), compute_path(path):
        for input_ids, mask in batches(data.sequences, args.batch_size, pad_id):
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)


# --- the parent ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--dataset",
        default=None,
        help="default: real prose from Debian's fortunes (2000-char rows)",
    )
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"]
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--batch-size", type=int, default=4, help="kvcalib's and the forward's batch size"
    )
    parser.add_argument(
        "--reps", type=int, default=1, help="runs of each (a, b, d, c in turn); medians are printed"
    )
    parser.add_argument(
        "--skip-oneshot", action="store_true", help="leave out (b), llm-compressor's oneshot"
    )
    parser.add_argument("--child", choices=["oneshot", "forward"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(REPO))
        (child_oneshot if args.child == "oneshot" else child_forward)(args)
        return

    print(provenance(), flush=True)
    require_model(args.model)
    with tempfile.TemporaryDirectory(prefix="kvcalib-bench-") as tmp:
        work = Path(tmp)
        default_dataset(args, work)
        env = child_env(args.threads)
        common = [
            "--num-samples",
            str(args.num_samples),
            "--max-seq-len",
            str(args.max_seq_len),
            "--dtype",
            args.dtype,
        ]
        child = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--model",
            args.model,
            "--dataset",
            args.dataset,
            "--batch-size",
            str(args.batch_size),
            *common,
            "--child",
        ]
        keys = "adc" if args.skip_oneshot else "abdc"
        runs: dict[str, list[tuple[float, float, float]]] = {key: [] for key in keys}
        info: dict = {}
        kvcalib = [
            sys.executable,
            "-m",
            "kvcalib",
            "calibrate",
            args.model,
            "--dataset",
            args.dataset,
            "--batch-size",
            str(args.batch_size),
            *common,
            "--json",
        ]
        for rep in range(args.reps):
            out = work / f"rep{rep}"
            *measured, stdout = run_measured([*kvcalib, "-o", str(out / "kvcalib")], env)
            runs["a"].append(tuple(measured))
            info = json.loads(stdout)
            if not args.skip_oneshot:
                *measured, _ = run_measured([*child, "oneshot", "--out", str(out / "oneshot")], env)
                runs["b"].append(tuple(measured))
            *measured, _ = run_measured(
                [*kvcalib, "-o", str(out / "absmax"), "--scale-objective", "absmax"], env
            )
            runs["d"].append(tuple(measured))
            *measured, _ = run_measured([*child, "forward"], env)
            runs["c"].append(tuple(measured))
            print(
                f"run {rep + 1}/{args.reps}: "
                + "   ".join(
                    f"{key} {runs[key][-1][0]:.1f} s wall, {runs[key][-1][1]:.1f} s CPU"
                    for key in keys
                ),
                flush=True,
            )

    med = {
        k: tuple(statistics.median(run[i] for run in v) for i in range(3)) for k, v in runs.items()
    }
    print(
        f"model {args.model}: {info['num_samples']} samples, {info['num_tokens']:,} tokens "
        f"(max {args.max_seq_len}/sample), dtype {args.dtype}, {args.threads} thread(s), "
        f"kvcalib batch {args.batch_size}, median of {args.reps} run(s)"
    )
    labels = {
        "a": "(a) kvcalib calibrate",
        "b": "(b) llm-compressor oneshot",
        "d": "(d) kvcalib, absmax objective",
        "c": "(c) full forward (floor)",
    }
    print(f"{'':30s} {'wall s':>8s} {'CPU s':>8s} {'peak RSS MiB':>13s}")
    for key, label in labels.items():
        if key in med:
            print(f"{label:30s} {med[key][0]:8.1f} {med[key][1]:8.1f} {med[key][2]:13.0f}")
    print(
        f"kvcalib observing: {info['tokens_per_s']:,.0f} tok/s, {info['seconds']:.1f} s inside calibrate(), "
        f"{info['objective_seconds']:.1f} s of it the scale objective's search"
    )
    if "b" in med:
        ratio = {i: med["a"][i] / med["b"][i] for i in range(3)}
        print(
            f"wall a/b = {ratio[0]:.2f} (target <= 0.5)   CPU a/b = {ratio[1]:.2f}   peak RSS a/b = {ratio[2]:.2f}"
        )
    ratio = {
        i: (med["a"][i] / med["c"][i], med["d"][i] / med["c"][i], med["a"][i] / med["d"][i])
        for i in range(3)
    }
    print(
        f"wall a/c = {ratio[0][0]:.2f} (target <= 0.85)   wall d/c = {ratio[0][1]:.2f}   "
        f"scale objective's cost a/d = {ratio[0][2]:.2f} (target <= 1.3)"
    )
    print(
        f"CPU  a/c = {ratio[1][0]:.2f}   CPU  d/c = {ratio[1][1]:.2f}   CPU  a/d = {ratio[1][2]:.2f}   "
        f"peak RSS a/c = {ratio[2][0]:.2f}, a/d = {ratio[2][2]:.2f}"
    )
    if (
        args.reps > 1
    ):  # each run's (a) and (c) a minute apart: less of the machine's drifting load between them
        paired = [a[0] / c[0] for a, c in zip(runs["a"], runs["c"])]
        print(
            f"wall a/c run by run: {', '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f})"
        )


if __name__ == "__main__":
    main()
