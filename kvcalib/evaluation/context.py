"""eval-context: what the scales do at the context lengths the FP8 cache exists for (K's absmax grows with
longer text and later positions; calibration sees short samples).

For each length L, samples are packed from the held-out text (rows joined by a blank line, tokenised once without
special tokens, cut into pieces placed after the tokenizer's leading tokens, e.g. BOS) and run once unquantised
(KVErrorMeter measures what each scale set would saturate) and, unless --saturation-only, once per scale set with
K/V in FP8. Per length and scale set: per layer the K/V saturation and absmax against the scale's clip level; ΔNLL
on the last quarter of positions, with a paired bootstrap over 64-token blocks (not independent: a lower bound)."""

from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcalib.core.errors import DatasetError, UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.core.schema import max_position_embeddings, text_config
from kvcalib.evaluation.emulate import KVErrorMeter, LayerQuantStats
from kvcalib.evaluation.pipeline import Prepared, prepare_scales
from kvcalib.evaluation.scoring import log_probs
from kvcalib.evaluation.significance import Interval, paired_bootstrap
from kvcalib.hf.compute import Float32Weights
from kvcalib.hf.data import leading_special_tokens, load_rows, resolve_column
from kvcalib.hf.memory import available_memory

__all__ = [
    "BLOCK",
    "ContextResult",
    "ContextRow",
    "check_lengths",
    "evaluate_context",
    "forward_bytes",
    "pack",
    "prepare_long_context",
]

BLOCK = 64  # scored positions per bootstrap unit
MIN_LENGTH = 8  # the last quarter must hold at least two predictions
MEMORY_SHARE = 0.8  # of the available memory a forward may plan to use


@dataclass(frozen=True)
class ContextRow:
    """One length and scale set in ContextResult's rows: length, name, samples, tokens, baseline_nll, delta_nll,
    delta_nll_interval, k_clipped_max, v_clipped_max (the worst layer's), k_beyond, v_beyond (the largest absmax / clip
    level: > 1 saturates), layers (LayerQuantStats)."""

    length: int
    name: str
    samples: int
    tokens: int  # predictions scored (last quarter of every sample)
    baseline_nll: float
    delta_nll: float | None  # None: saturation only (no forward with the scale set)
    delta_nll_interval: Interval | None
    layers: tuple[LayerQuantStats, ...]

    @property
    def k_clipped(self) -> float:
        return max((s.k.clipped for s in self.layers), default=0.0)

    @property
    def v_clipped(self) -> float:
        return max((s.v.clipped for s in self.layers), default=0.0)

    def beyond(self, kind: str) -> tuple[float, int]:
        """(largest absmax / clip threshold over layers, that layer) for kind "k" or "v"."""
        ratios = [
            (stats.absmax / stats.clip_at, s.layer)
            for s in self.layers
            if (stats := getattr(s, kind)).clip_at > 0
        ]
        return max(ratios, default=(0.0, -1))

    JSON = {
        "k_clipped_max": "k_clipped",
        "v_clipped_max": "v_clipped",
        "k_beyond": lambda row: row.beyond("k")[0],
        "v_beyond": lambda row: row.beyond("v")[0],
    }


@dataclass(frozen=True)
class ContextResult:
    """What `eval-context` measured; to_json() is its --json: checkpoint, target, max_positions (null: unknown),
    tokens_available, memory_bound, block (positions per bootstrap unit), rows (ContextRow), seconds."""

    checkpoint: str
    target: str
    max_positions: int | None
    tokens_available: int  # in the packed held-out text
    memory_bound: int  # the longest length whose forward fits (by forward_bytes)
    rows: tuple[ContextRow, ...]
    seconds: float

    JSON = {"block": lambda _: BLOCK}


def pack(stream: list[int], prefix: list[int], length: int, count: int) -> list[list[int]]:
    """Up to `count` samples of `length` tokens: `prefix`, then the next length - len(prefix) tokens of `stream`."""
    body = length - len(prefix)
    return [
        prefix + stream[i * body : (i + 1) * body] for i in range(min(count, len(stream) // body))
    ]


def forward_bytes(config: dict[str, Any], length: int, weight_bytes: int) -> int:
    """A generous estimate of one batch-1 forward's peak memory at `length` tokens: weights and float32 copies,
    float32 activations, one 256-query block's attention scores, the last quarter's (scored) logits and log-probs."""
    text = text_config(config)
    hidden = int(text.get("hidden_size") or 0)
    inter = int(text.get("intermediate_size") or 4 * hidden)
    heads, vocab = int(text.get("num_attention_heads") or 1), int(text.get("vocab_size") or 0)
    activations = length * (8 * hidden + 3 * inter) * 4
    scores = 3 * heads * 256 * length * 4
    logits = 3 * (length // 4 + 1) * vocab * 4
    return 3 * weight_bytes + activations + scores + logits


def check_lengths(
    lengths: tuple[int, ...], config: dict[str, Any], where: Path, weight_bytes: int, available: int
) -> int:
    """Each --lengths length at least MIN_LENGTH, within max_position_embeddings and memory; the memory bound."""
    limit = max_position_embeddings(config)
    bound = bisect.bisect_right(  # the longest length whose forward fits MEMORY_SHARE of `available` (0: none)
        range(1, 1 << 24),
        available * MEMORY_SHARE,
        key=lambda n: forward_bytes(config, n, weight_bytes),
    )
    for length in lengths:
        if length < MIN_LENGTH:
            raise UsageError(
                f"--lengths {length}: too short to score its last quarter",
                hint=f"pass lengths of {MIN_LENGTH} tokens or more",
            )
        if limit is not None and length > limit:
            raise UsageError(
                f"--lengths {length} is above the model's max_position_embeddings {limit} ({where})",
                hint=f"pass lengths up to {limit}",
            )
        if length > bound:
            need = forward_bytes(config, length, weight_bytes)
            raise UsageError(
                f"--lengths {length}: one forward needs about {need / 2**30:.1f} GiB, and "
                f"{available / 2**30:.1f} GiB is available (up to {bound} tokens fit)",
                hint=f"pass lengths up to {bound}, or run where more memory is free",
            )
    return bound


def packed_stream(
    dataset: str, tokenizer: Any, split: str, text_column: str | None
) -> tuple[list[int], list[int]]:
    """The held-out text as one token stream (rows joined by a blank line, no special tokens), and the prefix."""
    rows = load_rows(dataset, split)
    column = resolve_column(list(rows.column_names), text_column, dataset)
    text = "\n\n".join(str(t) for t in rows[column] if isinstance(t, str) and t.strip())
    stream = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    return list(stream), list(leading_special_tokens(tokenizer))


def _last_quarter_nll(ids: torch.Tensor, hook: Any, **forward: Any) -> torch.Tensor:
    """NLL of each of the last quarter's tokens [q] (float32), `hook` on K/V (and Q) as in eval's scoring."""
    q = ids.shape[1] // 4
    logp = log_probs(input_ids=ids, mask=None, hook=hook, keep=q + 1, **forward)
    return -logp[0].gather(-1, ids[0, -q:, None])[:, 0]


def run_length(
    samples: list[list[int]], job: Prepared, forward: Any, notify: ProgressCallback, nll: bool
) -> tuple[ContextRow, ...]:
    """Every sample of one length: the baseline with the meter riding along, then (with `nll`) each scale set."""
    length, n = len(samples[0]), len(samples)
    meter = KVErrorMeter(job.quantizers, job.run.device)
    hooks = {None: meter, **(job.quantizers if nll else {})}
    # per hook (None: the baseline), each sample's NLL in BLOCKs of the scored positions
    blocks = {name: [] for name in hooks}
    for i, sample in enumerate(samples):
        notify(Progress(f"context {length}", i, n, i * length, n * length))
        ids = torch.tensor([sample], device=job.run.device)
        for name, hook in hooks.items():
            blocks[name] += forward(ids, hook).double().split(BLOCK)
    base, tokens = [float(b.sum()) for b in blocks[None]], [b.numel() for b in blocks[None]]
    total = sum(tokens)
    deltas = {
        name: [float(r.sum()) - b for r, b in zip(blocks.get(name, ()), base)]
        for name in job.quantizers
    }
    return tuple(
        ContextRow(
            length,
            name,
            n,
            total,
            sum(base) / total,
            sum(d) / total if nll else None,
            paired_bootstrap(d, tokens),  # None without nll: no deltas
            tuple(meter.layer_stats(name)),
        )
        for name, d in deltas.items()
    )


def prepare_long_context(
    checkpoint: str | Path,
    dataset: str,
    lengths: tuple[int, ...],
    opts: Any,
    notify: ProgressCallback,
) -> tuple[Prepared, int, Any, list[int], list[int]]:
    """What eval-context and eval-needle share before a forward, scales and lengths checked and the text read:
    the prepared job, the memory bound, the tokenizer, the text as tokens and the prefix."""
    job = prepare_scales(checkpoint, opts)
    ckpt = job.run.checkpoint
    weight_bytes = sum(f.stat().st_size for f in ckpt.root.glob("*.safetensors"))
    available = available_memory(job.run.device).available
    bound = check_lengths(lengths, ckpt.config, ckpt.root, weight_bytes, available)
    notify(Progress("load-data"))
    tokenizer = job.tokenizer()
    return (job, bound, tokenizer, *packed_stream(dataset, tokenizer, opts.split, opts.text_column))


def evaluate_context(
    checkpoint: str | Path,
    dataset: str,
    lengths: tuple[int, ...],
    opts: Any,
    progress: ProgressCallback | None = None,
    nll: bool = True,
) -> ContextResult:
    """eval-context (the module docstring); without `nll` (--saturation-only) no ΔNLL, one forward a sample."""
    started, notify = time.perf_counter(), progress or no_progress
    job, bound, _, stream, prefix = prepare_long_context(checkpoint, dataset, lengths, opts, notify)
    packed = {length: pack(stream, prefix, length, opts.num_samples) for length in lengths}
    for length, samples in packed.items():
        if not samples:
            raise DatasetError(
                f"{dataset}: {len(stream)} tokens of text, too few for one sample of {length} "
                f"(--lengths {length})",
                hint="pass a longer held-out text, or shorter lengths",
            )
    forward = functools.partial(
        _last_quarter_nll, model=job.model(notify), compute=job.compute, weights=Float32Weights()
    )
    rows = tuple(
        row for samples in packed.values() for row in run_length(samples, job, forward, notify, nll)
    )
    return ContextResult(
        str(checkpoint),
        opts.target,
        max_position_embeddings(job.run.checkpoint.config),
        len(stream),
        bound,
        rows,
        time.perf_counter() - started,
    )
