"""Attention samples: what the scale objective scores, each layer's attention call on a few calibration sequences
(the same in every engine and rank) kept as the model made it; `attention_rows` recomputes those rows' output in
float32 with any K or V put in (the eager formula, tested against the model's own attention function), and
`projected` weighs it as the attention block's o_proj does."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcalib.hf.data import batched

__all__ = [
    "ROWS_PER_SEQUENCE",
    "SAMPLE_TOKENS",
    "AttentionSample",
    "AttentionSampler",
    "attention_error",
    "attention_rows",
    "projected",
    "sample_sequences",
]

# The objective's share: whole batches in the run's order until SAMPLE_TOKENS tokens of K/V are kept (at least one),
# ROWS_PER_SEQUENCE query rows of each, spread over its positions, alternately chosen from and held out.
SAMPLE_TOKENS = 2048
ROWS_PER_SEQUENCE = 16


@dataclass(frozen=True)
class AttentionSample:
    """One sequence's attention call at one layer (CPU tensors; q/k/v in float32, holding the model's values)."""

    query: torch.Tensor  # [heads, rows, head_dim]: the sampled query rows
    key: torch.Tensor  # [kv_heads, length, head_dim]
    value: torch.Tensor  # [kv_heads, length, head_dim]
    # [rows, length] float32: 0 where a row attends, -inf where masked (or the model's additive)
    bias: torch.Tensor
    held_out: torch.Tensor  # [rows] bool: scored for the report, never for the choice
    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads] float32 (GPT-OSS)
    mix: torch.Tensor | None = None  # [kv_heads, groups, head_dim, k]: _mix's (None: no o_proj)


def sample_sequences(
    sequences: tuple[tuple[int, ...], ...],
    batch_size: int,
    budget: int = SAMPLE_TOKENS,
) -> frozenset[tuple[int, ...]]:
    """The sequences the objective scores: whole batches of the run's own batching, in order, to `budget` tokens."""
    chosen = set()
    tokens = 0
    for chunk in batched(sequences, batch_size):
        if chosen and tokens >= budget:
            break
        chosen.update(chunk)
        tokens += sum(map(len, chunk))
    return frozenset(chosen)


class AttentionSampler:
    """Keeps the attention calls of the chosen sequences, per layer (see the module docstring)."""

    def __init__(
        self, num_layers: int, sequences: Iterable[tuple[int, ...]], rows: int = ROWS_PER_SEQUENCE
    ):
        self.sequences, self.rows = frozenset(sequences), rows
        self.samples = [[] for _ in range(num_layers)]
        self._batch = []  # (row in the batch, length) of the current batch's chosen rows
        self._mixes = {}  # per layer, its o_proj's R_hᵀ

    def start_batch(self, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        self._batch = [  # sums of an integer mask: ints
            (r, n)
            for r, n in enumerate(mask.sum(dim=1).tolist())
            if tuple(input_ids[r, :n].tolist()) in self.sequences
        ]

    def end_batch(self) -> None:
        self._batch = []

    def record(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
        module: torch.nn.Module,
    ) -> None:
        scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
        softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
        if self._batch and layer not in self._mixes:
            self._mixes[layer] = _mix(module, key.shape[1], *query.shape[1::2])
        for row, length in self._batch:
            # self.rows query positions spread evenly over 1..length-1, the last included, in order
            count = min(self.rows, length - 1)
            positions = (
                sorted({length - 1 - j * (length - 1) // count for j in range(count)})
                if length > 1
                else [0]
            )
            index = torch.tensor(positions, device=query.device)
            self.samples[layer].append(
                AttentionSample(
                    query=query[row].index_select(1, index).detach().float().cpu(),
                    key=key[row, :, :length].detach().float().cpu(),
                    value=value[row, :, :length].detach().float().cpu(),
                    bias=_bias(attention_mask, row, index, length),
                    held_out=torch.arange(len(positions)) % 2 == 1,
                    scaling=float(scaling),
                    softcap=float(softcap) if softcap else None,
                    sinks=sinks.detach().float().cpu().clone()
                    if isinstance(sinks, torch.Tensor)
                    else None,
                    mix=self._mixes[layer],
                )
            )


def _mix(module: torch.nn.Module, kv_heads: int, heads: int, head_dim: int) -> torch.Tensor | None:
    """[kv_heads, groups, head_dim, k]: R_hᵀ of each query head's o_proj block W_h ([hidden, head_dim]) = Q_h R_h,
    so that ||x R_hᵀ|| = ||W_h x||; None where the module has no such o_proj (its output is scored as it is)."""
    weight = getattr(getattr(module, "o_proj", None), "weight", None)
    if weight is None or weight.is_meta or weight.shape[-1] != heads * head_dim:
        return None
    blocks = weight.detach().cpu().double().unflatten(1, (heads, head_dim)).transpose(0, 1)
    return torch.linalg.qr(blocks, mode="r").R.mT.float().unflatten(0, (kv_heads, -1))


def _bias(
    attention_mask: torch.Tensor | None, row: int, index: torch.Tensor, length: int
) -> torch.Tensor:
    """The additive mask of the sampled rows over the sequence's keys (causal where the model passed none)."""
    if attention_mask is None:  # SDPA's is_causal path: no padding, no window
        rows = torch.arange(length)[None, :] <= index.cpu()[:, None]
    else:
        rows = attention_mask[row if attention_mask.shape[0] > 1 else 0, 0]
        rows = rows.index_select(0, index)[:, :length].cpu()
    if rows.dtype == torch.bool:
        return torch.zeros(rows.shape).masked_fill(~rows, float("-inf"))
    additive = rows.float()  # eager's masks: 0 where allowed, the dtype's min where masked
    return additive.masked_fill(additive < -1e30, float("-inf"))


def attention_rows(
    sample: AttentionSample,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    probabilities: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, probabilities) of the sampled rows in float32: `softmax(scaling q kᵀ [softcap] + mask [sinks]) v`,
    `key`/`value` replacing the sample's (leading dimensions broadcast), query heads grouped under their KV head
    (output [..., kv_heads, groups * rows, head_dim]); `probabilities` skips the softmax."""
    kv_heads = sample.key.shape[0]
    groups = sample.query.shape[0] // kv_heads
    if probabilities is None:
        q = sample.query.float().reshape(kv_heads, groups * sample.query.shape[1], -1)
        logits = _scores(q, (sample.key if key is None else key).float()).mul_(sample.scaling)
        if sample.softcap is not None:
            logits = torch.tanh(logits / sample.softcap) * sample.softcap
        logits = logits.add_(sample.bias.repeat(groups, 1))
        if (
            sample.sinks is not None
        ):  # one logit per query head that takes probability and gives no value
            sinks = sample.sinks.float().reshape(kv_heads, groups, 1)
            sinks = sinks.repeat_interleave(sample.query.shape[1], 1).expand(*logits.shape[:-1], 1)
            combined = torch.cat([logits, sinks], dim=-1)
            probabilities = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[
                ..., :-1
            ]
        else:
            probabilities = torch.softmax(logits, dim=-1)
    return _weighted(
        probabilities, (sample.value if value is None else value).float()
    ), probabilities


def projected(sample: AttentionSample, output: torch.Tensor) -> torch.Tensor:
    """attention_rows' `output` ([..., kv_heads, groups * rows, head_dim]) as o_proj weighs it: each query head's rows
    times its R_hᵀ, so squared norms and errors are those of the attention block's output (heads apart)."""
    if sample.mix is None:
        return output
    split = output.unflatten(
        -2, (sample.mix.shape[1], -1)
    )  # [..., kv_heads, groups, rows, head_dim]
    return torch.matmul(split, sample.mix).flatten(-3, -2)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q kᵀ, leading dimensions of k folded into one bmm batch (broadcasting would copy kᵀ first)."""
    if k.dim() == 3:
        return torch.matmul(q, k.transpose(-1, -2))
    batched = torch.bmm(
        q.expand(*k.shape[:-3], *q.shape).reshape(-1, *q.shape[1:]),
        k.reshape(-1, *k.shape[-2:]).transpose(1, 2),
    )
    return batched.view(*k.shape[:-3], *q.shape[:-1], k.shape[-2])


def _weighted(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p v, one matmul per index of a leading dimension only one has (broadcasting would copy the other)."""
    if p.dim() == v.dim():
        return torch.matmul(p, v)
    count = p.shape[0] if p.dim() > v.dim() else v.shape[0]
    shape = (count, *p.shape[-3:-1], v.shape[-1])
    out = p.new_empty(shape)
    for i in range(count):
        torch.matmul(p[i] if p.dim() > v.dim() else p, v[i] if v.dim() > p.dim() else v, out=out[i])
    return out


def attention_error(
    samples: Sequence[AttentionSample], k_scale: Any, v_scale: Any, target: Any
) -> float | None:
    """Relative attention-block output error ||O(K̂, V̂) - O|| / ||O|| (projected: after o_proj), K and V quantised on
    `target`; None: no samples."""
    from kvcalib.core import fp8

    if not samples:
        return None
    error, norm = [], []
    for sample in samples:
        reference, _ = attention_rows(sample)
        k = fp8.fake_quantize(sample.key, _per_head(k_scale), target)
        v = fp8.fake_quantize(sample.value, _per_head(v_scale), target)
        output, _ = attention_rows(sample, key=k, value=v)
        error.append(float(projected(sample, output - reference).double().pow(2).sum()))
        norm.append(float(projected(sample, reference).double().pow(2).sum()))
    total = math.fsum(norm)
    return math.sqrt(math.fsum(error) / total) if total > 0 else 0.0


def _per_head(scale: Any) -> Any:
    """A float as is; a [1, H, 1, 1] (or [H]) per-head scale as [H, 1, 1] for [H, length, head_dim]."""
    return scale.reshape(-1, 1, 1) if isinstance(scale, torch.Tensor) else scale
