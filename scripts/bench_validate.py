#!/usr/bin/env python3
"""Time `kvcalib.validate` on a synthetic 100-shard checkpoint against reading every tensor once.

Builds (in a temporary directory, removed afterwards unless --keep) a Llama-shaped
checkpoint: --shards weight files of about --shard-mb MB each, an index, config.json with
the KV-only quantization_config, kv_scales.safetensors for --layers layers and the
provenance file. Then it times, each --reps times, with the page cache warm and (where
the OS lets us drop a file's cached pages) cold:

  validate   kvcalib.validate(ckpt, target="trn2")
  baseline   safetensors.torch.load_file on every shard, touching every page (every tensor read once)

and prints the medians and their ratio. Then the whole process, as a user or a CI job pays it:
`python -m kvcalib validate CKPT` next to `python -c pass`, on the synthetic checkpoint and on
each --checkpoint given (e.g. the demo's out/smollm2-fp8kv-trn2). Nothing is asserted: timing is
for reading.

    python scripts/bench_validate.py [--shards 100] [--shard-mb 4] [--layers 80] [--reps 5] [--checkpoint DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from provenance import provenance  # this folder is on sys.path when run as a script
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvcalib  # noqa: E402

# internal: the synthetic checkpoint is written with kvcalib's own scale math, file and key names
from kvcalib.core.fp8 import TARGETS, scale_from_absmax  # noqa: E402
from kvcalib.core.schema import (  # noqa: E402
    CONFIG_FILENAME,
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    SCALES_FILENAME,
    kv_only_quantization_config,
    neuron_scale_key,
)

TENSORS_PER_SHARD = 8


def build(root: Path, shards: int, shard_mb: float, layers: int) -> int:
    """Write the synthetic checkpoint; returns its size in bytes."""
    generator = torch.Generator().manual_seed(0)
    numel = max(1, int(shard_mb * 2**20 / 4 / TENSORS_PER_SHARD))
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {
            f"model.layers.{s % layers}.block{s}.w{t}.weight": torch.randn(
                numel, generator=generator
            )
            for t in range(TENSORS_PER_SHARD)
        }
        save_file(tensors, root / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    target = TARGETS["trn2"]
    fp8_max = target.fp8_max
    scales, entries = {}, []
    for i in range(layers):
        k_absmax, v_absmax = 8.0 + i / 10, 3.0 + i / 10
        k, v = (
            scale_from_absmax(k_absmax, target).reshape(1),
            scale_from_absmax(v_absmax, target).reshape(1),
        )
        scales[neuron_scale_key(i, "k")], scales[neuron_scale_key(i, "v")] = k, v
        entries.append(
            {
                "layer": i,
                "k": {"absmax": k_absmax, "scale": k.item()},
                "v": {"absmax": v_absmax, "scale": v.item()},
            }
        )
    provenance = {"target": "trn2", "fp8_max": fp8_max, "layers": entries}
    save_file(
        scales, root / SCALES_FILENAME, metadata={"format": "pt", "kvcalib": json.dumps(provenance)}
    )
    weight_map.update(dict.fromkeys(scales, SCALES_FILENAME))
    total += 4 * len(scales)

    _write_json(
        root / INDEX_FILENAME, {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    _write_json(root / PROVENANCE_FILENAME, provenance)
    _write_json(
        root / CONFIG_FILENAME,
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": layers,
            "quantization_config": kv_only_quantization_config(),
        },
    )
    return sum(p.stat().st_size for p in root.iterdir())


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def drop_page_cache(root: Path) -> bool:
    """Ask the OS to forget the cached pages of every file (no root needed); False if it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def validate_once(root: Path) -> None:
    report = kvcalib.validate(root, target="trn2")
    if report.findings:
        raise SystemExit(f"the synthetic checkpoint should validate clean: {report.findings}")


def read_everything(root: Path) -> None:
    """load_file may map a file lazily: touch one value per 4 KiB page so every byte is read."""
    for path in sorted(root.glob("*.safetensors")):
        for tensor in load_file(path).values():
            flat = tensor.reshape(-1)
            flat[:: max(1, 4096 // flat.element_size())].sum()


def timed(fn, root: Path, reps: int, cold: bool) -> float:
    times = []
    for _ in range(reps):
        if cold:
            drop_page_cache(root)
        started = time.perf_counter()
        fn(root)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def process_seconds(argv: list[str], reps: int) -> float:
    """The median wall time of running `argv` as a new process (output discarded)."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def process_timings(checkpoints: list[Path], reps: int) -> None:
    """`kvcalib validate` as a whole process, against an interpreter that does nothing."""
    idle = process_seconds([sys.executable, "-c", "pass"], reps)
    print(
        f"\n{'whole process (median of ' + str(reps) + ')':<34}{'seconds':>9}{'x python -c pass':>18}"
    )
    print(f"{'python -c pass':<34}{idle:>9.3f}{1:>17.0f}x")
    for ckpt in checkpoints:
        took = process_seconds([sys.executable, "-m", "kvcalib", "validate", str(ckpt)], reps)
        print(f"{'kvcalib validate ' + ckpt.name:<34}{took:>9.3f}{took / idle:>17.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--shard-mb", type=float, default=4.0)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to build (default: a temporary directory)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        action="append",
        default=[],
        help="also time the whole `kvcalib validate` process on this checkpoint (repeatable)",
    )
    args = parser.parse_args()
    print(provenance(), flush=True)

    base = Path(tempfile.mkdtemp(prefix="kvcalib-bench-", dir=args.dir))
    root = base / "ckpt"
    root.mkdir()
    try:
        started = time.perf_counter()
        size = build(root, args.shards, args.shard_mb, args.layers)
        print(
            f"built {args.shards} shards + scales for {args.layers} layers, {size / 2**20:.0f} MiB, "
            f"in {time.perf_counter() - started:.1f} s ({root})"
        )
        validate_once(root)  # imports (compressed-tensors, torch) once, outside the timings
        can_drop = drop_page_cache(root)
        rows = [("warm", False)] + ([("cold", True)] if can_drop else [])
        print(
            f"{'page cache':<11}{'validate (median)':>19}{'read all tensors (median)':>28}{'ratio':>10}"
        )
        for label, cold in rows:
            v = timed(validate_once, root, args.reps, cold)
            b = timed(read_everything, root, max(1, min(args.reps, 3)), cold)
            print(f"{label:<11}{v * 1000:>16.1f} ms{b * 1000:>25.1f} ms{b / v:>9.0f}x")
        if not can_drop:
            print("(this OS cannot drop a file's cached pages: cold timings skipped)")
        process_timings([root, *args.checkpoint], args.reps)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
