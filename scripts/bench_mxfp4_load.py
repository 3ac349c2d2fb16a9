#!/usr/bin/env python3
"""One GPT-OSS-120B layer's load (read + dequantise its MXFP4 experts), side by side, at each torch thread count.

On the slice scripts/bench_gpt_oss.py builds (real dimensions, random weights, experts MXFP4 as released; built
into --work when it is not there), one process, layer 0's shard (1.63 GiB), for each of --threads:
  read          the shard's bytes read into memory (no conversion; what safetensors maps), page cache warm
  transformers  the stream engine's layer load (LayerStream.layer) with transformers' dequantisation
                (`_convert_moe_packed_tensors`) a few experts at a time: kvcalib at 5b17fb3
  table         the same load with kvcalib.hf.mxfp4.dequantize (a table lookup; kvcalib now)
and once, first: `cold read`, the read after posix_fadvise(DONTNEED) on the shard (from the device unless the
kernel kept the pages). Seconds, and each against transformers' at the same thread count.

    python scripts/bench_mxfp4_load.py [--work DIR] [--layers 1] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent


def transformers_own(blocks, scales, *, per_chunk: int = 4, **kwargs):
    """kvcalib.hf.mxfp4.expert_chunks at 5b17fb3: transformers' dequantisation, `per_chunk` experts at a time."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors as convert

    out = None
    for first in range(0, blocks.shape[0], per_chunk):
        part = convert(
            blocks[first : first + per_chunk], scales[first : first + per_chunk], **kwargs
        )
        out = part.new_empty((blocks.shape[0], *part.shape[1:])) if out is None else out
        out[first : first + per_chunk] = part
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--work", type=Path, default=None, help="kept; a slice already there is reused"
    )
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO)]
    import torch
    from bench_gpt_oss import build_slice

    from kvcalib.calibration.stream import open_stream
    from kvcalib.core.checkpoint import Checkpoint
    from kvcalib.hf import mxfp4

    print(provenance(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvcalib-gpt-oss-"))
    model = work / f"gpt-oss-120b-slice-{args.layers}"
    if not (model / "config.json").exists():
        print(f"building the slice ({args.layers} layers) in {model} ...", flush=True)
        build_slice(model, args.layers, max(args.threads))
    checkpoint = Checkpoint.open(model)
    keys = [k for k in checkpoint.files.key_files if k.startswith("model.layers.0.")]
    shard = model / str(checkpoint.files.file_of(keys[0]))
    stream = open_stream(checkpoint, None, torch.device("cpu"), False)

    def read() -> None:
        with open(shard, "rb", buffering=0) as f:
            f.readinto(bytearray(shard.stat().st_size))

    def load() -> None:
        with stream.layer(0):
            pass

    def timed(run) -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    with open(shard, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    cold = timed(read)
    print(f"layer 0: {shard.stat().st_size / 2**30:.2f} GiB; cold read: {cold:.2f} s", flush=True)
    print(f"{'threads':>7}  {'read':>12}  {'transformers':>12}  {'table':>12}")
    table = mxfp4.dequantize
    for threads in args.threads:
        torch.set_num_threads(threads)
        warm = timed(read)
        mxfp4.dequantize = transformers_own
        try:
            before = timed(load)
        finally:
            mxfp4.dequantize = table
        now = timed(load)
        print(
            f"{threads:>7}  {warm:>6.2f} s {warm / before:>4.2f}  {before:>6.1f} s 1.00  "
            f"{now:>6.1f} s {now / before:>4.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
