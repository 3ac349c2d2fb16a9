"""The scale objective: per layer (or per KV head), the K and V scales that keep attention right.

`absmax / fp8_max` never clips and can be the worst scale: a large, nearly constant K channel near an FP8 rounding
boundary flips between two grid points from token to token, noise in every q·k; saturated, it is constant, which
softmax ignores. So a candidate is scored by the squared error of the attention block's output, after o_proj: the
sum over query heads of ||W_h Δo_h||² (W_h: the head's o_proj columns; a head whose V is small and o_proj columns
large counts as the model counts it; the heads' cross terms are left out), from kvcalib.hf.samples (the model's own
Q, mask, scaling, soft-capping, sinks) with K, then V, fake-quantised, on every numerics the checkpoint is served
with (core.fp8.served_numerics: a trn2 scale saturates at 240 x s on trn2, 448 x s on trn3 and GPU), and judged by
its largest error there. Candidates: absmax x 2^(-j/2) (j = 0..10), absmax / M for each larger FP8 max M, 1.0, and
absmax x 2^(j/4) (j = 1..3). Half of each sequence's sampled query rows choose, the other half confirm and report:
- a clip must at least halve absmax's error (GAIN) on both halves; the least clipping within TOLERANCE of the best;
- else a scale that clips nothing absmax keeps wins if it cuts absmax's error by a tenth (WIDER_GAIN) on both.
Per KV head with `attn_head`. Sums are exactly rounded (math.fsum): any number of ranks chooses as one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvcalib.core import fp8
from kvcalib.core.choice import ScaleChoice
from kvcalib.hf.samples import AttentionSample, attention_rows, projected

__all__ = [
    "ABSMAX",
    "FACTORS",
    "GAIN",
    "TOLERANCE",
    "WIDER",
    "WIDER_GAIN",
    "Candidates",
    "Gather",
    "Scored",
    "candidates",
    "choose",
    "sample_terms",
    "scored_numerics",
    "search",
    "sum_terms",
    "worst",
]

FACTORS = tuple(2.0 ** (-j / 2) for j in range(11))
WIDER = tuple(
    2.0 ** (j / 4) for j in range(1, 4)
)  # never clip: other places on the FP8 grid for the same values
GAIN = 0.5  # a clip must halve absmax's attention error (equivalent scales differ by up to ~30 %)
WIDER_GAIN = 0.9  # a wider scale must cut it by a tenth (V's equally good scales differ by ~1-3 %, K's by ~5 %)
TOLERANCE = 0.25  # of those that do, the least clipping within 25 % of their best
UNIT_LABEL = "1.0"
ABSMAX = "absmax"  # the candidate absmax / FP8 max, and --scale-objective absmax: it alone (llm-compressor's rule)


@dataclass(frozen=True)
class Candidates:
    """One layer's candidate scales for one kind: absmax, the clips (least clipping first), 1.0, the wider ones."""

    labels: tuple[str, ...]
    scales: torch.Tensor  # [C, kv_heads] float32
    ranges: torch.Tensor  # [C, kv_heads]: the |x| each scale maps to the FP8 max
    clip_at: (
        torch.Tensor
    )  # [C, kv_heads]: |x| above this saturates on the target (range, after the scale's rounding)

    @property
    def unit(self) -> int:
        return self.labels.index(UNIT_LABEL)

    def on(self, numerics: fp8.Target) -> Candidates:
        """The same scales as another server applies them: where it saturates."""
        return replace(
            self,
            clip_at=fp8.from_fp8_domain(
                torch.full_like(self.scales, numerics.fp8_max), self.scales, numerics
            ),
        )

    @property
    def keeps_range(self) -> torch.Tensor:
        """[C, kv_heads] bool: the scale is at least absmax's, so it clips nothing absmax keeps."""
        return self.scales >= self.scales[0]


def candidates(
    head_absmax: torch.Tensor, target: fp8.Target, per_head: bool, kv_heads: int | None = None
) -> Candidates:
    """The grid for one layer's K or V (head_absmax: [kv_heads], or [1]); per tensor, the `kv_heads` share it."""
    heads = head_absmax.float().reshape(-1)
    base = heads if per_head else heads.max().expand(kv_heads or heads.numel())
    # the scale a server of these scales with a larger FP8 max would write (absmax / 448 for trn2: llm-compressor's)
    others = {
        target.fp8_max / t.fp8_max: f"absmax/{t.fp8_max:g}"
        for t in fp8.served_numerics(target)
        if t.fp8_max > target.fp8_max
    }
    factors = sorted(
        {*FACTORS, *others}, reverse=True
    )  # absmax (1) first: every other factor is below it
    labels = [ABSMAX if f == 1.0 else others.get(f, f"absmax x{f:.4g}") for f in factors]
    labels += [UNIT_LABEL, *(f"absmax x{f:.4g}" for f in WIDER)]
    unit = len(factors)
    ranges = torch.stack(
        [base * f for f in factors]
        + [torch.full_like(base, target.fp8_max)]
        + [base * f for f in WIDER]
    )
    stacked = fp8.scale_from_absmax(ranges, target)  # element-wise: every candidate's scale at once
    stacked[unit] = 1.0
    return Candidates(tuple(labels), stacked, ranges, stacked).on(target)


def sample_terms(
    sample: AttentionSample,
    grids: Sequence[tuple[Candidates, Candidates]],
    numerics: Sequence[fp8.Target],
    subset: tuple[list[int], list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's terms per numerics (`grids`: K and V candidates, Candidates.on): float64 [numerics, 2, 4, C,
    kv_heads] (squared output error on choosing / held-out rows, elements saturated, elements) and [2, kv_heads]
    (the output's squared norm per half). `subset`: the K and V candidates to score (others 0); None: all."""
    output, probabilities = attention_rows(sample)
    held = sample.held_out.repeat(
        output.shape[1] // sample.query.shape[1]
    )  # the same rows in every group
    halves = torch.stack([~held, held], dim=1).double()
    terms = torch.zeros(len(numerics), 2, 4, *grids[0][0].scales.shape, dtype=torch.float64)
    terms[:, :, 3] = sample.key.shape[-1] * sample.key.shape[-2]  # K and V have the same shape
    for n, chip in enumerate(numerics):
        for kind, (values, cands) in enumerate(zip((sample.key, sample.value), grids[n])):
            chosen = (
                torch.arange(cands.scales.shape[0])
                if subset is None
                else torch.tensor(subset[kind], dtype=int)
            )
            if not len(chosen):
                continue
            quantised = fp8.fake_quantize(
                values[None], cands.scales[chosen, :, None, None], chip
            )  # [C, Hkv, L, D]
            put = (
                {"key": quantised}
                if kind == 0
                else {"value": quantised, "probabilities": probabilities}
            )
            error = (
                projected(sample, attention_rows(sample, **put)[0] - output)
                .pow(2)
                .sum(dim=-1)
                .double()
            )  # [C, Hkv, rows]
            terms[n, kind, :2, chosen] = (error @ halves).permute(2, 0, 1)
            saturated = (
                values.abs().flatten(-2)[None] > cands.clip_at[chosen, :, None]
            )  # [C, Hkv, L * D]
            terms[n, kind, 2, chosen] = saturated.sum(dim=-1).double()
    return terms, (projected(sample, output).pow(2).sum(dim=-1, dtype=torch.float64) @ halves).T


def sum_terms(per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exactly rounded sum over samples (math.fsum, element by element): independent of their order."""
    stacked = torch.stack([t.double() for t in per_sample]).reshape(len(per_sample), -1)
    sums = [math.fsum(column) for column in stacked.T.tolist()]
    return torch.tensor(sums, dtype=torch.float64).reshape(per_sample[0].shape)


@dataclass(frozen=True)
class Scored:
    """One layer's K or V as the attention objective scored it (`choose`): its candidates, the pick per KV head (one
    entry per tensor, by the module's rule), and the record of the pick as it is written."""

    candidates: Candidates
    index: tuple[int, ...]
    choice: ScaleChoice


def worst(errors: torch.Tensor) -> list[float]:
    """[numerics, C, kv_heads] squared errors -> per candidate, the largest over numerics of its sum over heads."""
    return [max(math.fsum(row) for row in per) for per in errors.transpose(0, 1).tolist()]


def choose(
    terms: torch.Tensor,
    norms: torch.Tensor,
    cands: Candidates,
    per_head: bool,
    numerics: Sequence[fp8.Target] = (),
) -> Scored:
    """The scored candidates for one kind from its summed terms ([numerics, 4, C, kv_heads], target first; or
    [4, C, kv_heads]) and the norms ([2, kv_heads]); each candidate judged by its error on the server where it does
    worst."""
    terms = terms[None] if terms.dim() == 3 else terms
    choosing, held, clipped, count = terms[:, 0], terms[:, 1], terms[0, 2], terms[0, 3]
    keeps = cands.keeps_range
    if per_head:
        index = tuple(
            _pick(
                choosing[:, :, h].amax(dim=0).tolist(),
                held[:, :, h].amax(dim=0).tolist(),
                keeps[:, h].tolist(),
            )
            for h in range(choosing.shape[2])
        )
    else:
        index = (_pick(worst(choosing), worst(held), keeps.all(dim=1).tolist()),)
    heads, elements, norm = (
        held.shape[2],
        max(math.fsum(count[0].tolist()), 1.0),
        math.fsum(norms[1].tolist()),
    )

    def held_error(pick: tuple[int, ...], n: int = 0) -> float:
        """The held-out relative attention-output error of candidate `pick` (per KV head) on numerics `n`."""
        return (
            math.sqrt(math.fsum(held[n, c, h].item() for h, c in enumerate(pick)) / norm)
            if norm > 0
            else 0.0
        )

    chosen = index * heads if len(index) == 1 else index
    labels = {cands.labels[c] for c in chosen}
    choice = ScaleChoice(
        label=labels.pop() if len(labels) == 1 else "per head",
        clipped=math.fsum(clipped[c, h].item() for h, c in enumerate(chosen)) / elements,
        attention_error=held_error(chosen),
        attention_error_absmax=held_error((0,) * heads),
        attention_error_unit=held_error((cands.unit,) * heads),
        attention_error_on=tuple(
            (chip.name, held_error(chosen, n)) for n, chip in enumerate(numerics)
        ),
    )
    return Scored(cands, index, choice)


def _pick(errors: Sequence[float], held_out: Sequence[float], keeps_range: Sequence[bool]) -> int:
    """The candidate from its squared errors on the choosing and held-out rows (0 is absmax): see the module."""

    def cuts(
        c: int, gain: float
    ) -> bool:  # below gain x absmax's relative error on both halves (squared errors)
        return errors[c] < gain**2 * errors[0] and held_out[c] < gain**2 * held_out[0]

    better = [c for c in range(1, len(errors)) if not keeps_range[c] and cuts(c, GAIN)]
    if better:
        best = min(errors[c] for c in better)
        return next(c for c in better if errors[c] <= best * (1 + TOLERANCE) ** 2)
    return min(
        (c for c in range(len(errors)) if c == 0 or (keeps_range[c] and cuts(c, WIDER_GAIN))),
        key=lambda c: (errors[c], c),
    )


Gather = Callable[
    [list[Any]], list[Any]
]  # every rank's list, concatenated (one process: the list itself)


def scored_numerics(target: fp8.Target, per_head: bool) -> tuple[fp8.Target, ...]:
    """What search scores on: fp8.served_numerics; per-head scales on the target only (GPU vLLM alone loads them)."""
    return (target,) if per_head else fp8.served_numerics(target)


# a float64 sum of a few thousand non-negative terms is within 1e-12 of the exact one (math.fsum's in choose())
_MARGIN = 1.0 + 1e-9


def search(
    samples: Sequence[Sequence[AttentionSample]],
    k_heads: Sequence[torch.Tensor],
    v_heads: Sequence[torch.Tensor],
    target: fp8.Target,
    per_head: bool,
    gather: Gather = lambda local: local,
) -> list[tuple[Scored, Scored]]:
    """Per layer: K and V scored, from every rank's samples (`gather`, twice a layer). absmax
    and 1.0 are scored first (absmax's error is the bar); the others until their error so far reaches it."""
    numerics = scored_numerics(target, per_head)
    chosen = []
    for i, layer in enumerate(samples):
        kv_heads = layer[0].key.shape[0] if layer else None
        k, v = (candidates(heads[i], target, per_head, kv_heads) for heads in (k_heads, v_heads))
        grids = [(k.on(chip), v.on(chip)) for chip in numerics]
        anchors = ([0, k.unit], [0, v.unit])
        pairs = [
            pair
            for rank in gather([[sample_terms(s, grids, numerics, anchors) for s in layer]])
            for pair in rank
        ]
        if not pairs:
            raise ValueError(f"layer {i}: no attention samples")
        bars = sum_terms([t for t, _ in pairs])
        # each other candidate's terms, sample after sample, until its error so far reaches its bar
        gains = [  # [C(, kv_heads)]
            torch.where(
                c.keeps_range if per_head else c.keeps_range.all(dim=1), WIDER_GAIN**2, GAIN**2
            ).double()
            for c in grids[0]
        ]
        bar = [
            bars[:, kind, :2, 0] if per_head else bars[:, kind, :2, 0].sum(dim=-1)
            for kind in range(2)
        ]
        active = tuple(
            [c for c in range(len(gains[kind])) if c not in anchors[kind]] for kind in range(2)
        )
        sums, out = torch.zeros_like(bars), []
        for sample in layer:
            if not any(active):
                break
            terms, _ = sample_terms(sample, grids, numerics, active)
            terms[:, :, 3] = 0.0  # the sample's elements are counted once, with the anchors
            out.append(terms)
            sums += terms
            for kind in range(2):
                errors = (
                    sums[:, kind, :2] if per_head else sums[:, kind, :2].sum(dim=-1)
                )  # [numerics, 2, C(, kv_heads)]
                past = (
                    errors.amax(dim=0) >= gains[kind] * bar[kind].amax(dim=0)[:, None] * _MARGIN
                )  # [2, C(, kv_heads)]
                ruled = past.any(dim=0).all(dim=1) if per_head else past.any(dim=0)
                active[kind][:] = [c for c in active[kind] if not ruled[c]]
        terms = sum_terms([t for t, _ in pairs] + [t for rank in gather([out]) for t in rank])
        norms = sum_terms([n for _, n in pairs])
        chosen.append(
            (
                choose(terms[:, 0], norms, k, per_head, numerics),
                choose(terms[:, 1], norms, v, per_head, numerics),
            )
        )
    return chosen


FAR_WORSE = 2.0  # absmax's attention error this many times the chosen scale's (and above WORTH_WARNING): warn
WORTH_WARNING = 0.05


def absmax_warnings(
    layers: Sequence[Any], samples: Sequence[Sequence[AttentionSample]], target: fp8.Target
) -> list[str]:
    """A line for every layer's K or V where absmax / fp8_max would have been far worse than the chosen scale."""
    lines = []
    for layer in layers:
        for kind in "kv":
            choice = getattr(layer, kind).choice
            if not choice or choice.attention_error_absmax <= max(
                FAR_WORSE * choice.attention_error, WORTH_WARNING
            ):
                continue
            line = (
                f"layer {layer.layer} {kind.upper()}: absmax/{target.fp8_max:g} would cost attention-output error "
                f"{choice.attention_error_absmax:.3f} against {choice.attention_error:.3f} for the chosen "
                f"{choice.label} ({choice.clipped:.1%} clipped)"
            )
            layer_samples = samples[layer.layer] if layer.layer < len(samples) else ()
            if (
                layer_samples
            ):  # the KV head with the most channels of |mean| >= absmax / 4, std < 5 % of it
                x = torch.cat(
                    [(s.key if kind == "k" else s.value).float() for s in layer_samples], dim=1
                )
                mean, std = x.mean(dim=1), x.std(dim=1, correction=0)
                flagged = (mean.abs() >= 0.25 * getattr(layer, kind).absmax) & (
                    std <= 0.05 * mean.abs()
                )
                head = int(flagged.sum(dim=1).argmax())
                channels = sorted(
                    flagged[head].nonzero().flatten().tolist(),
                    key=lambda c: -abs(float(mean[head, c])),
                )
                listed = ", ".join(
                    f"{c} (mean {float(mean[head, c]):.4g}, std {float(std[head, c]):.2g})"
                    for c in channels[:6]
                )
                if channels:
                    line += f"; KV head {head} has near-constant outlier channels: {listed}"
            lines.append(line)
    return lines
