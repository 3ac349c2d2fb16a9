#!/usr/bin/env python3
"""bf16 calibrate against float32 calibrate and a float32 full forward, on the same tokens, in one run.

Fresh processes in turn, on the same model, samples and threads:

  (a) bf16 calibrate      `kvcalib calibrate MODEL --dtype bfloat16` (--bf16-compute auto: float32
                          matmuls with bf16 rounding where this CPU has no native bf16 matmul)
  (b) float32 calibrate   the same with `--dtype float32`
  (c) float32 forward     a full `AutoModelForCausalLM` forward in float32 over the same batches
                          (scripts/bench_calibrate.py's floor), writing nothing
  (d) bf16 native         `--dtype bfloat16 --bf16-compute native` (with --with-native): what the
                          bf16 matmuls cost on this CPU without kvcalib's float32 path

Prints the path each calibrate used, the medians of --reps runs, and the ratios a/b (target
<= 1.3 on CPUs without native bf16) and a/c. With --emulate-avx2 every child runs as on an
AVX2-only CPU: torch and oneDNN limited to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL)
and kvcalib told the CPU has no avx512_bf16 (KVCALIB_CPU_FLAGS). Timing is for reading: nothing
is asserted.

    python scripts/bench_bf16.py [--model DIR] [--num-samples 16] [--max-seq-len 256] [--threads 1]
        [--reps 1] [--emulate-avx2] [--with-native]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calibrate import (  # noqa: E402
    DEFAULT_MODEL,
    REPO,
    child_env,
    default_dataset,
    require_model,
    run_measured,
)
from provenance import provenance  # noqa: E402

AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "KVCALIB_CPU_FLAGS": "fpu sse2 avx avx2 fma",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--dataset", default=None, help="default: real prose from Debian's fortunes"
    )
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--emulate-avx2", action="store_true", help="run every child as on an AVX2-only CPU"
    )
    parser.add_argument(
        "--with-native", action="store_true", help="also (d): bf16 with native bf16 matmuls"
    )
    args = parser.parse_args()
    print(provenance(), flush=True)
    require_model(args.model)
    with tempfile.TemporaryDirectory(prefix="kvcalib-bench-bf16-") as tmp:
        work = Path(tmp)
        default_dataset(args, work)
        env = child_env(args.threads, **(AVX2_ENV if args.emulate_avx2 else {}))
        data = [
            "--num-samples",
            str(args.num_samples),
            "--max-seq-len",
            str(args.max_seq_len),
            "--batch-size",
            str(args.batch_size),
        ]

        def calibrate_cmd(out: Path, *extra: str) -> list[str]:
            return [
                sys.executable,
                "-m",
                "kvcalib",
                "calibrate",
                args.model,
                "--dataset",
                args.dataset,
                "-o",
                str(out),
                *data,
                *extra,
                "--json",
            ]

        runs = {
            "a": ("(a) bf16 calibrate", lambda out: calibrate_cmd(out, "--dtype", "bfloat16")),
            "b": ("(b) float32 calibrate", lambda out: calibrate_cmd(out, "--dtype", "float32")),
            "c": (
                "(c) float32 full forward",
                lambda out: [
                    sys.executable,
                    str(REPO / "scripts" / "bench_calibrate.py"),
                    "--model",
                    args.model,
                    "--dataset",
                    args.dataset,
                    *data,
                    "--dtype",
                    "float32",
                    "--child",
                    "forward",
                ],
            ),
        }
        if args.with_native:
            runs["d"] = (
                "(d) bf16 native matmuls",
                lambda out: calibrate_cmd(out, "--dtype", "bfloat16", "--bf16-compute", "native"),
            )
        wall: dict[str, list[float]] = {key: [] for key in runs}
        compute: dict[str, str] = {}
        for rep in range(args.reps):
            for key, (_label, cmd) in runs.items():
                seconds, _cpu, _rss, stdout = run_measured(cmd(work / f"{key}{rep}"), env)
                wall[key].append(seconds)
                if stdout.strip():
                    info = json.loads(stdout)
                    compute[key] = info["compute"]
                    tokens = info["num_tokens"]
            print(
                f"run {rep + 1}/{args.reps}: "
                + "   ".join(f"{k} {wall[k][-1]:.1f} s" for k in runs),
                flush=True,
            )

    med = {key: statistics.median(values) for key, values in wall.items()}
    print(
        f"model {args.model}: {args.num_samples} samples, {tokens:,} tokens (max {args.max_seq_len}/sample), "
        f"{args.threads} thread(s), batch {args.batch_size}, median of {args.reps} run(s)"
        + (", every child as on an AVX2-only CPU" if args.emulate_avx2 else "")
    )
    for key, (label, _cmd) in runs.items():
        print(
            f"{label:28s} {med[key]:7.1f} s wall"
            + (f"   compute: {compute[key]}" if key in compute else "")
        )
    print(
        f"wall a/b = {med['a'] / med['b']:.2f} (bf16 / float32 calibrate; target <= 1.3)   "
        f"wall a/c = {med['a'] / med['c']:.2f} (bf16 calibrate / float32 full forward)"
        + (
            f"   d/b = {med['d'] / med['b']:.2f} (native bf16 matmuls / float32)"
            if "d" in med
            else ""
        )
    )


if __name__ == "__main__":
    main()
