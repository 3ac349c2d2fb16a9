"""The scale objective: per layer (or per KV head), the K and V scales that keep attention right.

`absmax / fp8_max` never clips, and that can be the worst scale there is. A K channel that is
large and nearly constant across tokens (bias-driven, in a RoPE pair that barely rotates) sits
on a coarse part of the FP8 grid, and where its value is near a rounding boundary it flips
between two grid points from token to token: noise far larger than its own variation, multiplied
into every q·k. Saturating it instead makes it exactly constant, which softmax ignores. What
matters is the error of the attention output, not of K: SQNR ranks such scales backwards.

The search ("attention grid"): for every layer, candidate scales `absmax x 2^(-j/2)` (j = 0..10,
so 1 down to 1/32 of the never-clipping scale), `absmax / M` for each chip in the table with a
larger FP8 max M (448 for trn2), 1.0, and the wider scales `absmax x 2^(j/4)` (j = 1..3). Each
is scored on the attention samples (kvcalib.hf.samples: the model's own Q, mask, scaling,
soft-capping and sinks, K/V as the cache stores them) by the squared error of the attention
output with K (then V) fake-quantised, against the unquantised output; V is scored through the
exact probabilities. A candidate is scored on every numerics the checkpoint is served with
(core.fp8.served_numerics: a trn2 scale saturates at 240 x s on trn2 but at 448 x s on trn3, GPU
vLLM and vLLM CPU, where a clip chosen for 240 no longer saturates and can land a near-constant
channel on rounding boundaries), and a candidate's error is its largest on any of them: a scale
is chosen for every server it will meet. Half of each sequence's sampled query rows choose, the
other half (held out) confirm and report.

Two kinds of candidate, two bars:
- A clip must at least halve absmax's error (GAIN) on both halves: scales that are equally good
  differ by up to ~30 % on a few hundred rows (where FP8 rounding falls), and every clip costs
  headroom at long context. Of the clips that do, the least-clipping one within TOLERANCE (25 %)
  of their best is chosen. Saturated near-constant channels are exact constants whatever text
  comes later, so a clip that does this is preferred.
- Otherwise a candidate that clips nothing absmax keeps (a scale at least absmax's: the wider
  ones, and 1.0 where absmax is under the FP8 max) costs no headroom. FP8 is a floating-point
  grid, so such a scale differs from absmax only in where each value falls between two grid
  points, which matters for near-constant channels. The one with the lowest error wins when it
  is at least a tenth (WIDER_GAIN) under absmax's on the choosing and the held-out rows alike:
  V's equally good scales differ by 1-3 %, K's by ~5 %, and a pick by noise is no better.
Every error is the candidate's on the server where it does worst (absmax's too). Per KV head with
`attn_head`, where heads are scored apart. Sums are exactly rounded (math.fsum), so batches dealt
to any number of ranks give the same choice as one process.

absmax's error is the bar every other candidate must get under, so it (and 1.0, whose error is
reported) is scored on every sample first; a candidate whose error so far already reaches its bar
is scored no further (errors only grow with samples): the same choices and reported errors as
scoring everything, with a fraction of the candidate-samples scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvcalib.core import fp8
from kvcalib.hf.samples import AttentionSample, Workspace, attention_rows

__all__ = ["ABSMAX", "ATTENTION", "DEFAULT_OBJECTIVE", "FACTORS", "GAIN", "OBJECTIVES", "TOLERANCE", "WIDER", "WIDER_GAIN",
           "Candidates", "Gather", "KindChoice", "Reference", "candidates", "choose", "sample_terms", "scored_numerics",
           "search", "sum_terms"]

ATTENTION = "attention"
ABSMAX = "absmax"
OBJECTIVES = (ATTENTION, ABSMAX)
DEFAULT_OBJECTIVE = ATTENTION
FACTORS = tuple(2.0 ** (-j / 2) for j in range(11))
WIDER = tuple(2.0 ** (j / 4) for j in range(1, 4))  # never clip: other places on the FP8 grid for the same values
GAIN = 0.5  # a clip must halve absmax's attention error (equivalent scales differ by up to ~30 %)
WIDER_GAIN = 0.9  # a wider scale must cut it by a tenth (V's equally good scales differ by ~1-3 %, K's by ~5 %)
TOLERANCE = 0.25  # of those that do, the least clipping within 25 % of their best
UNIT_LABEL = "1.0"
ABSMAX_LABEL = "absmax"


@dataclass(frozen=True)
class Candidates:
    """One layer's candidate scales for one kind: absmax first, then the clips from the least clipping, 1.0, and the
    wider scales."""

    labels: tuple[str, ...]
    scales: torch.Tensor  # [C, kv_heads] float32
    ranges: torch.Tensor  # [C, kv_heads]: the |x| each scale maps to the FP8 max

    clip_at: torch.Tensor  # [C, kv_heads]: |x| above this saturates on the target (range, after the scale's rounding)
    reciprocal: torch.Tensor | None = None  # [C, kv_heads] on Neuron: the multiplier into FP8 (fp8.neuron_reciprocal)

    @property
    def unit(self) -> int:
        return self.labels.index(UNIT_LABEL)

    def on(self, numerics: fp8.Target) -> Candidates:
        """The same scales as another server applies them: where it saturates, and its multiplier into FP8."""
        clip_at = fp8.from_fp8_domain(torch.full_like(self.scales, numerics.fp8_max), self.scales, numerics)
        return replace(self, clip_at=clip_at,
                       reciprocal=fp8.neuron_reciprocal(self.scales) if numerics.neuron else None)

    @property
    def keeps_range(self) -> torch.Tensor:
        """[C, kv_heads] bool: the scale is at least absmax's, so it clips nothing absmax keeps."""
        return self.scales >= self.scales[0]


def candidates(head_absmax: torch.Tensor, target: fp8.Target, per_head: bool, kv_heads: int | None = None
               ) -> Candidates:
    """The grid for one layer's K or V (head_absmax: [kv_heads], or [1] from an engine that sees only tensors);
    per tensor, every one of the `kv_heads` heads shares the layer's."""
    heads = head_absmax.float().reshape(-1)
    base = heads if per_head else heads.max().expand(kv_heads or heads.numel())
    # the scale a chip with a larger FP8 max would write (absmax / 448 for trn2: llm-compressor's and GPU vLLM's)
    others = {target.fp8_max / t.fp8_max: f"absmax/{t.fp8_max:g}" for t in fp8.TARGETS.values()
              if t.fp8_max > target.fp8_max}
    factors = sorted({*FACTORS, *others}, reverse=True)  # absmax (1) first: every other factor is below it
    labels = [ABSMAX_LABEL if f == 1.0 else others.get(f, f"absmax x{f:.4g}") for f in factors]
    labels += [UNIT_LABEL, *(f"absmax x{f:.4g}" for f in WIDER)]
    unit = len(factors)
    ranges = torch.stack([base * f for f in factors] + [torch.full_like(base, target.fp8_max)]
                         + [base * f for f in WIDER])
    stacked = fp8.scale_from_absmax(ranges, target)  # element-wise: every candidate's scale at once
    stacked[unit] = 1.0
    return Candidates(tuple(labels), stacked, ranges, stacked).on(target)


@dataclass(frozen=True)
class Reference:
    """What every candidate of one sample is compared with, computed once: the unquantised attention rows, and
    which candidates reach the FP8 max on the sample (per kind: their indices)."""

    output: torch.Tensor  # [Hkv, groups * rows, D]
    probabilities: torch.Tensor  # [Hkv, groups * rows, length]
    halves: torch.Tensor  # [groups * rows, 2] float64: 1.0 where a row is a choosing row, a held-out row
    norms: torch.Tensor  # [2, Hkv] float64: the output's squared norm on each half
    saturating: tuple[frozenset[int], frozenset[int]]  # the candidates that saturate some of K, of V (clip_at)
    clamping: tuple[frozenset[int], frozenset[int]]  # the candidates that put some of K, of V past the FP8 max

    @classmethod
    def of(cls, sample: AttentionSample, k: Candidates, v: Candidates, target: fp8.Target) -> Reference:
        output, probabilities = attention_rows(sample)
        held = sample.held_out.repeat(output.shape[1] // sample.query.shape[1])  # the same rows in every group
        halves = torch.stack([~held, held], dim=1).double()
        norms = (output.pow(2).sum(dim=-1, dtype=torch.float64) @ halves).T
        return cls(output, probabilities, halves, norms, (), ()).on(sample, k, v, target)

    def on(self, sample: AttentionSample, k: Candidates, v: Candidates, numerics: fp8.Target) -> Reference:
        """The same reference, with which candidates saturate or clamp on `numerics` (k, v: on it, Candidates.on)."""
        saturating, clamping = [], []
        for values, cands in ((sample.key, k), (sample.value, v)):
            peak = values.abs().amax(dim=(1, 2))  # [Hkv]
            # float32 products and quotients round monotonically: the peak's is the largest there is
            largest = fp8.to_fp8_domain(peak, cands.scales, numerics)  # [C, Hkv]
            saturating.append(_indices((cands.clip_at < peak).any(dim=1)))
            clamping.append(_indices((largest > numerics.fp8_max).any(dim=1)))
        return replace(self, saturating=tuple(saturating), clamping=tuple(clamping))


def _indices(mask: torch.Tensor) -> frozenset[int]:
    return frozenset(mask.nonzero().flatten().tolist())


def sample_terms(sample: AttentionSample, k: Candidates, v: Candidates, target: fp8.Target,
                 work: Workspace | None = None, subset: tuple[list[int], list[int]] | None = None,
                 reference: Reference | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's additive terms: float64 [2 kinds, 4, C, kv_heads] (per kind: the squared attention-output
    error on the choosing rows, on the held-out rows, the K/V elements each candidate saturates, the elements)
    and [2, kv_heads] (the unquantised output's squared norm on the choosing and the held-out rows). `work`: the
    buffers of a search, reused from sample to sample. `subset`: the K and the V candidates to score (the others'
    terms are 0); None: all. `reference`: the sample's, when it is scored more than once."""
    work = work or Workspace()
    reference = reference or Reference.of(sample, k, v, target)
    out = torch.zeros(2, 4, k.scales.shape[0], k.scales.shape[1], dtype=torch.float64)
    out[:, 3] = float(sample.key.shape[-1] * sample.key.shape[-2])  # K and V have the same shape
    for kind, (values, cands) in enumerate(((sample.key, k), (sample.value, v))):
        listed = list(range(cands.scales.shape[0])) if subset is None else subset[kind]
        if not listed:
            continue
        chosen = torch.tensor(listed)
        quantised = _fake_quantized(values, cands.scales[chosen][:, :, None, None], target, work,
                                    None if cands.reciprocal is None else cands.reciprocal[chosen][:, :, None, None],
                                    clamp=not reference.clamping[kind].isdisjoint(listed))  # [C, Hkv, L, D]
        if kind == 0:
            output, _ = attention_rows(sample, key=quantised, work=work)
        else:
            output, _ = attention_rows(sample, value=quantised, probabilities=reference.probabilities, work=work)
        error = output.sub_(reference.output).pow_(2).sum(dim=-1).double()  # [C, Hkv, groups * rows]
        out[kind, :2, chosen] = (error @ reference.halves).permute(2, 0, 1)
        saturating = [i for i, c in enumerate(listed) if c in reference.saturating[kind]]
        if saturating:  # the others saturate nothing of this sample
            magnitude = values.abs().flatten(-2)  # [Hkv, L * D]
            limits = cands.clip_at[chosen[saturating]]
            flags = work.get("saturated", (limits.shape[0], *magnitude.shape))
            # as 0.0/1.0: a comparison into float32 and its sum (exact below 2^24) are vectorised, a bool one is not
            out[kind, 2, chosen[saturating]] = torch.gt(magnitude[None], limits[:, :, None], out=flags).sum(dim=-1).double()
    return out, reference.norms


def _fake_quantized(values: torch.Tensor, scale: torch.Tensor, target: fp8.Target, work: Workspace | None = None,
                    reciprocal: torch.Tensor | None = None, clamp: bool = True) -> torch.Tensor:
    """fp8.fake_quantize(values[None], scale, target), every candidate at once, in `work`'s buffers (valid until
    the next call). A negative value that rounds to zero is +0 (fp8.round_to_e4m3_). `reciprocal`: Neuron's
    multiplier for `scale`, when known; `clamp` False: no value reaches the FP8 max (the clamp is skipped)."""
    if target.toward_zero:
        return fp8.fake_quantize(values[None], scale, target)
    work = work or Workspace()
    shape = (scale.shape[0], *values.shape)
    scaled = work.get("fp8", shape)
    if target.neuron:  # x * r, clamp, cast, / r (core.fp8.to_fp8_domain / from_fp8_domain)
        r = fp8.neuron_reciprocal(scale) if reciprocal is None else reciprocal
        torch.mul(values[None], r, out=scaled)
    else:  # x / s, saturate, cast, * s
        torch.div(values[None], scale, out=scaled)
    if clamp:
        scaled.clamp_(-target.fp8_max, target.fp8_max)
    q = fp8.round_to_e4m3_(scaled, work.get("scratch", shape))
    return q.div_(r) if target.neuron else q.mul_(scale)


def sum_terms(per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exactly rounded sum over samples (math.fsum, element by element): independent of their order."""
    if not per_sample:
        raise ValueError("no attention samples to sum")
    stacked = torch.stack([t.double() for t in per_sample]).reshape(len(per_sample), -1)
    sums = [math.fsum(column) for column in stacked.T.tolist()]
    return torch.tensor(sums, dtype=torch.float64).reshape(per_sample[0].shape)


@dataclass(frozen=True)
class KindChoice:
    """What the objective chose for one layer's K or V, and what the alternatives would have cost."""

    label: str  # the chosen candidate ("absmax", "absmax x0.5", "1.0", ...)
    index: tuple[int, ...]  # the chosen candidate per KV head (one entry per tensor)
    clipped: float  # the fraction of the sample's elements the chosen scale saturates on the target
    error: float  # held-out relative attention-output error ||ΔO|| / ||O|| of the chosen scale, on the target
    error_absmax: float
    error_unit: float
    errors_on: tuple[tuple[str, float], ...] = ()  # (numerics, the chosen scale's held-out error there), target first

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "clipped": self.clipped, "attention_error": self.error,
                "attention_error_absmax": self.error_absmax, "attention_error_unit": self.error_unit,
                "attention_error_on": dict(self.errors_on)}


def _relative(error: float, norm: float) -> float:
    return math.sqrt(error / norm) if norm > 0 else 0.0


def _worst(errors: torch.Tensor) -> list[float]:
    """[numerics, C, kv_heads] squared errors -> per candidate, the largest over numerics of its (exactly rounded)
    sum over heads: the layer's error on the server where the candidate does worst."""
    return [max(math.fsum(row) for row in per) for per in errors.transpose(0, 1).tolist()]


def choose(terms: torch.Tensor, norms: torch.Tensor, cands: Candidates, per_head: bool,
           numerics: Sequence[fp8.Target] = ()) -> KindChoice:
    """The choice for one kind from its summed terms ([numerics, 4, C, kv_heads], the target's first; [4, C,
    kv_heads] for the target alone) and the reference norms ([2, kv_heads]). Each candidate, absmax included, is
    judged by its error on the server where it does worst: a scale is chosen for every server that applies it."""
    terms = terms[None] if terms.dim() == 3 else terms
    choosing, held, clipped, count = terms[:, 0], terms[:, 1], terms[0, 2], terms[0, 3]
    keeps = cands.keeps_range
    if per_head:
        index = tuple(_pick(choosing[:, :, h].amax(dim=0).tolist(), held[:, :, h].amax(dim=0).tolist(),
                            keeps[:, h].tolist()) for h in range(choosing.shape[2]))
    else:
        index = (_pick(_worst(choosing), _worst(held), keeps.all(dim=1).tolist()),) * choosing.shape[2]

    def held_error(per_head_index: Sequence[int], n: int = 0) -> float:
        err = math.fsum(held[n, c, h].item() for h, c in enumerate(per_head_index))
        return _relative(err, math.fsum(norms[1].tolist()))

    heads = range(choosing.shape[2])
    labels = {cands.labels[c] for c in index}
    return KindChoice(
        label=labels.pop() if len(labels) == 1 else "per head",
        index=index if per_head else index[:1],
        clipped=math.fsum(clipped[c, h].item() for h, c in zip(heads, index)) / max(math.fsum(count[0].tolist()), 1.0),
        error=held_error(index), error_absmax=held_error([0] * len(heads)),
        error_unit=held_error([cands.unit] * len(heads)),
        errors_on=tuple((chip.name, held_error(index, n)) for n, chip in enumerate(numerics)),
    )


def _pick(errors: Sequence[float], held_out: Sequence[float], keeps_range: Sequence[bool]) -> int:
    """The candidate for one kind from its squared errors on the choosing and the held-out rows (candidate 0 is
    absmax; `keeps_range`: the candidate clips nothing absmax keeps), each on the server where it does worst. A clip
    where one at least halves (GAIN) absmax's error on both halves: of those, the first (least clipping) within
    TOLERANCE of their best. Else, of absmax and the candidates that keep its range and cut its error by a tenth
    (WIDER_GAIN) on both halves, the lowest on the choosing rows."""
    def cuts(c: int, gain: float) -> bool:  # below gain x absmax's relative error on both halves (squared errors)
        return errors[c] < gain**2 * errors[0] and held_out[c] < gain**2 * held_out[0]

    better = [c for c in range(1, len(errors)) if not keeps_range[c] and cuts(c, GAIN)]
    if better:
        best = min(errors[c] for c in better)
        return next(c for c in better if errors[c] <= best * (1 + TOLERANCE) ** 2)
    return min((c for c in range(len(errors)) if c == 0 or (keeps_range[c] and cuts(c, WIDER_GAIN))),
               key=lambda c: (errors[c], c))


Gather = Callable[[list[Any]], list[Any]]  # every rank's list, concatenated (one process: the list itself)


def scored_numerics(target: fp8.Target, per_head: bool) -> tuple[fp8.Target, ...]:
    """The numerics search scores every candidate on: each server the target's scales are for
    (fp8.served_numerics); per-head scales serve on GPU vLLM's FlashAttention alone (neither Neuron nor vLLM CPU
    loads them), so those are scored on the target only."""
    return (target,) if per_head else fp8.served_numerics(target)


def search(samples: Sequence[Sequence[AttentionSample]], k_heads: Sequence[torch.Tensor],
           v_heads: Sequence[torch.Tensor], target: fp8.Target, per_head: bool,
           gather: Gather = lambda local: local) -> list[tuple[KindChoice, KindChoice, Candidates, Candidates]]:
    """Per layer: the K and V choices (and their candidates), from every rank's samples (`gather`, twice a layer).

    Every candidate is scored on each numerics the checkpoint will be served with (fp8.served_numerics: for trn2
    also the 448-range servers, where the same scale saturates at 448 x s) and judged by its error where that is
    largest (choose).
    absmax and 1.0 are scored on every sample first: absmax's error is the bar every other candidate must get
    under (GAIN, WIDER_GAIN) to be chosen. The others are then scored sample by sample, and a candidate stops being
    scored once its error so far already reaches its bar: errors only grow with more samples, so it could not be
    chosen. The choice, and every error and clipped fraction it reports, are those of scoring everything (on a rank,
    the bar is every rank's absmax and the sums its own samples'; gathered, they only grow). One layer at a time:
    each sample's reference attention is computed once and kept only while its layer is scored."""
    work = Workspace()
    numerics = scored_numerics(target, per_head)
    chosen = []
    for i, layer in enumerate(samples):
        kv_heads = layer[0].key.shape[0] if layer else None
        k, v = (candidates(heads[i], target, per_head, kv_heads) for heads in (k_heads, v_heads))
        grids = [(k.on(chip), v.on(chip)) for chip in numerics]
        scored = [(sample, [ref.on(sample, *grid, chip) for grid, chip in zip(grids, numerics)])
                  for sample, ref in ((s, Reference.of(s, k, v, target)) for s in layer)]
        anchors = ([0, k.unit], [0, v.unit])
        local = [_terms(sample, refs, grids, numerics, work, anchors) for sample, refs in scored]
        pairs = [pair for rank in gather([local]) for pair in rank]
        if not pairs:
            raise ValueError(f"layer {i}: no attention samples")
        bars = sum_terms([t for t, _ in pairs])
        rest = _scored_until_ruled_out(scored, grids, numerics, per_head, bars, anchors, work)
        terms = sum_terms([t for t, _ in pairs] + [t for rank in gather([rest]) for t in rank])
        norms = sum_terms([n for _, n in pairs])
        chosen.append((choose(terms[:, 0], norms, k, per_head, numerics),
                       choose(terms[:, 1], norms, v, per_head, numerics), k, v))
    return chosen


def _terms(sample: AttentionSample, references: Sequence[Reference], grids: Sequence[tuple[Candidates, Candidates]],
           numerics: Sequence[fp8.Target], work: Workspace, subset: tuple[list[int], list[int]] | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_terms on every numerics, stacked: [numerics, 2 kinds, 4, C, kv_heads], and the norms."""
    per = [sample_terms(sample, *grid, chip, work, subset, ref) for ref, grid, chip in zip(references, grids, numerics)]
    return torch.stack([t for t, _ in per]), per[0][1]


# a float64 sum of a few thousand non-negative terms is within 1e-12 of the exact one: a candidate is ruled out
# only this far past its bar, so that the exactly rounded sums choose() compares are past it too
_MARGIN = 1.0 + 1e-9


def _scored_until_ruled_out(layer: Sequence[tuple[AttentionSample, Sequence[Reference]]],
                            grids: Sequence[tuple[Candidates, Candidates]], numerics: Sequence[fp8.Target],
                            per_head: bool, bars: torch.Tensor, anchors: tuple[list[int], list[int]],
                            work: Workspace) -> list[torch.Tensor]:
    """The terms of every candidate but the anchors, sample after sample, each until `bars` (absmax's summed
    terms, [numerics, 2, 4, C, kv_heads]) rule it out."""
    k, v = grids[0]
    active = tuple([c for c in range(cands.scales.shape[0]) if c not in anchors[kind]] for kind, cands in enumerate((k, v)))
    sums = torch.zeros_like(bars)
    out = []
    for sample, references in layer:
        if not any(active):
            break
        terms, _ = _terms(sample, references, grids, numerics, work, active)
        terms[:, :, 3] = 0.0  # the sample's elements are counted once, with the anchors
        out.append(terms)
        sums += terms
        ruled = [_ruled_out(sums[:, kind, :2], bars[:, kind, :2, 0], cands.keeps_range, per_head)
                 for kind, cands in enumerate((k, v))]
        active = tuple([c for c in active[kind] if not ruled[kind][c]] for kind in range(2))
    return out


def _ruled_out(errors: torch.Tensor, absmax: torch.Tensor, keeps_range: torch.Tensor, per_head: bool) -> list[bool]:
    """Per candidate: whether its squared errors so far ([numerics, 2 halves, C, kv_heads]), on the server where they
    are largest, already reach its bar on one half or the other (per head: on every head), against absmax's whole
    ones on its worst server ([numerics, 2, kv_heads]): _pick could not choose it."""
    if per_head:
        gain = torch.where(keeps_range, WIDER_GAIN**2, GAIN**2).double()  # [C, kv_heads]
        worst, bar = errors.amax(dim=0), absmax.amax(dim=0)  # [2, C, kv_heads], [2, kv_heads]
        return (worst >= gain * bar[:, None] * _MARGIN).any(dim=0).all(dim=1).tolist()
    gain = torch.where(keeps_range.all(dim=1), WIDER_GAIN**2, GAIN**2).double()  # [C]
    worst, bar = errors.sum(dim=3).amax(dim=0), absmax.sum(dim=2).amax(dim=0)  # [2, C], [2]
    return (worst >= gain * bar[:, None] * _MARGIN).any(dim=0).tolist()


FAR_WORSE = 2.0  # absmax's attention error this many times the chosen scale's (and above WORTH_WARNING): warn
WORTH_WARNING = 0.05


def near_constant_channels(samples: Sequence[AttentionSample], kind: str, absmax: float,
                           limit: int = 6) -> tuple[int, list[tuple[int, float, float]]] | None:
    """(head, [(channel, mean, std)]) of the head with the most near-constant outlier channels: |mean| at
    least a quarter of the layer's absmax, std under 5 % of |mean|, over every sampled token. None: none."""
    if not samples:
        return None
    x = torch.cat([(s.key if kind == "k" else s.value).float() for s in samples], dim=1)  # [Hkv, tokens, D]
    mean, std = x.mean(dim=1), x.std(dim=1, correction=0)
    flagged = (mean.abs() >= 0.25 * absmax) & (std <= 0.05 * mean.abs())
    if not bool(flagged.any()):
        return None
    head = int(flagged.sum(dim=1).argmax())
    channels = sorted(flagged[head].nonzero().flatten().tolist(), key=lambda c: -abs(float(mean[head, c])))
    return head, [(c, float(mean[head, c]), float(std[head, c])) for c in channels[:limit]]


def absmax_warnings(layers: Sequence[Any], samples: Sequence[Sequence[AttentionSample]], target: fp8.Target
                    ) -> list[str]:
    """A line for every layer's K or V where absmax / fp8_max would have been far worse than the chosen scale."""
    lines = []
    for layer in layers:
        for kind in "kv":
            choice = getattr(layer, f"{kind}_choice")
            if not choice or choice["attention_error_absmax"] <= max(FAR_WORSE * choice["attention_error"],
                                                                      WORTH_WARNING):
                continue
            line = (f"layer {layer.layer} {kind.upper()}: absmax/{target.fp8_max:g} would cost attention-output error "
                    f"{choice['attention_error_absmax']:.3f} against {choice['attention_error']:.3f} for the chosen "
                    f"{choice['label']} ({choice['clipped']:.1%} clipped)")
            found = near_constant_channels(samples[layer.layer] if layer.layer < len(samples) else (), kind,
                                           getattr(layer, f"{kind}_absmax"))
            if found is not None:
                head, channels = found
                listed = ", ".join(f"{c} (mean {m:.4g}, std {s:.2g})" for c, m, s in channels)
                line += f"; KV head {head} has near-constant outlier channels: {listed}"
            lines.append(line)
    return lines
