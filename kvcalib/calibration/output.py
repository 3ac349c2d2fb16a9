"""The whole-model step: the attention objective's close calls settled by what the model outputs.

The attention objective scores each layer alone, and its pick rule (the least clipping within 25 % of the best)
cannot see that the cost at the output is not monotone in the clip: a near-constant K channel flips on FP8 rounding
boundaries at one scale and saturates (constant, ignored by softmax) at a deeper one. So where a layer's candidates
differ materially (KindChoice.material: a clip is on the table, or the best beats the chosen by a tenth), its
shortlist (the chosen, the 2 lowest attention errors, absmax) is scored by the model itself: next-token KL against
the unquantised cache on TOKENS of held-out calibration rows (never the objective's), every other layer at its current
choice, in the target's numerics and its server's order (Neuron: a fresh-K/V prefill of each row's first half,
then decode steps reading FP8; emulate.FreshPrefill). A coordinate pass in layer order: an early layer's change
moves every later layer's inputs, so later layers are weighed against the early layers' settled choices.

The lowest mean KL wins; candidates whose cost is indistinguishable from it (the paired interval over rows of
the difference reaches 0) tie, and of those the least clipping wins, then the objective's own. The pass runs at most
`budget` forwards (BUDGET_SHARE of the calibration's tokens, MIN_FORWARDS at least): the material kinds with a clip
on the table first, then those where absmax's attention error is largest. It needs the whole model: the stream
engine's run loads it when it fits in memory, else keeps the objective's choices and says so. Under torchrun the
rows' batches are shared round-robin and every row's sum gathered: each rank decides as one process does, to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvcalib.calibration.objective import OUTPUT, Candidates, Gather, KindChoice
from kvcalib.calibration.options import StepReport
from kvcalib.calibration.scales import with_headroom
from kvcalib.core import fp8
from kvcalib.core.cpu import ComputePath
from kvcalib.evaluation.emulate import FreshPrefill, KVQuantizer, Scale, decode_rows, head_scale
from kvcalib.evaluation.layers import OneLayer
from kvcalib.evaluation.pipeline import log_probs
from kvcalib.evaluation.significance import paired_bootstrap
from kvcalib.hf.compute import Float32Weights
from kvcalib.hf.data import batches

__all__ = [
    "BUDGET_SHARE",
    "MIN_FORWARDS",
    "OUTPUT",
    "ROW_TOKENS",
    "TOKENS",
    "StepReport",
    "budget",
    "decide",
    "held_out_rows",
    "output_step",
]

TOKENS = 1024  # held-out calibration tokens the step scores on (half what the objective samples)
ROW_TOKENS = 128  # each row at most this long (more rows for the paired intervals); Neuron order scores the 2nd half
MIN_ROW_TOKENS = 8
MIN_ROWS, MAX_ROWS = 4, 32
BUDGET_SHARE = 0.1  # the step's forwards, in tokens, at most this share of the calibration's
MIN_FORWARDS = 5
TOP = 1024  # KL over the reference's TOP most likely tokens and the rest lumped (a lower bound of the full KL)
LOGIT_BYTES = 64 << 20  # the log-probabilities one step batch may hold

Choices = list[tuple[KindChoice, KindChoice, Candidates, Candidates]]


def held_out_rows(
    sequences: Sequence[Sequence[int]],
    chose: frozenset[tuple[int, ...]],
    tokens: int = TOKENS,
    row_tokens: int = ROW_TOKENS,
) -> list[tuple[int, ...]]:
    """Calibration rows the objective did not choose on, in order, cut to `row_tokens`, until `tokens` (at most
    MAX_ROWS rows)."""
    out: list[tuple[int, ...]] = []
    for seq in sequences:
        if sum(map(len, out)) >= tokens or len(out) == MAX_ROWS:
            break
        if tuple(seq) not in chose and len(seq) >= MIN_ROW_TOKENS:
            out.append(tuple(seq[:row_tokens]))
    return out


def budget(calibration_tokens: int, step_tokens: int) -> int:
    """Forwards over the held-out rows the step may run: BUDGET_SHARE of the calibration's tokens, MIN_FORWARDS."""
    return max(MIN_FORWARDS, int(BUDGET_SHARE * calibration_tokens / max(step_tokens, 1)))


@dataclass
class _Scorer:
    """Per-row KL sums of the model's next-token distributions against the unquantised run's, batch by batch."""

    model: torch.nn.Module
    rows: list[tuple[int, ...]]
    target: fp8.Target
    compute: ComputePath
    pad: int
    device: torch.device
    rank: int = 0
    world: int = 1
    gather: Gather = lambda local: local

    def __post_init__(self) -> None:
        vocab = int(self.model.get_output_embeddings().weight.shape[0])
        size = max(1, LOGIT_BYTES // (4 * vocab * max(len(r) for r in self.rows)))
        shares = enumerate(batches(tuple(self.rows), size, self.pad))
        self.batches = [b for i, b in shares if i % self.world == self.rank]
        self.weights = Float32Weights()
        self.fresh = self.target.order == fp8.NEURON_ORDER
        self.reference = [self._reference(ids, mask) for ids, mask in self.batches]
        self.tokens = self._gathered(
            [scored.sum(dim=1).double() for _, _, scored in self.reference]
        )

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, hook: Any) -> torch.Tensor:
        ids, mask = ids.to(self.device), mask.to(self.device)
        hook = (
            OneLayer(None, None)
            if hook is None
            else FreshPrefill(hook, mask)
            if self.fresh
            else hook
        )
        return log_probs(self.model, ids, mask, hook, compute=self.compute, weights=self.weights)

    def _reference(
        self, ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logp = self._forward(ids, mask, None)
        top, index = logp.topk(min(TOP, logp.shape[-1]), dim=-1)
        rest = torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))
        scored = (mask[:, 1:] & mask[:, :-1]).bool().to(logp.device)
        if self.fresh:
            scored &= decode_rows(mask.to(logp.device))[:, :-1]
        return torch.cat([top, rest[..., None]], dim=-1), index, scored

    def kl(self, quantizer: KVQuantizer) -> list[float]:
        """Every row's summed KL (rows in the single process's order), with K/V through `quantizer`."""
        sums = []
        for (ids, mask), (ref, index, scored) in zip(self.batches, self.reference):
            logq = self._forward(ids, mask, quantizer)
            top = logq.gather(-1, index)
            q = torch.cat(
                [top, torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))[..., None]], dim=-1
            )
            per_token = (ref.exp() * (ref - q)).sum(-1).double()
            sums.append(torch.where(scored, per_token, 0.0).sum(dim=1))
        return self._gathered(sums)

    def _gathered(self, local: list[torch.Tensor]) -> list[float]:
        """Per-batch row values from every rank, back in the single process's batch order."""
        mine = [(i * self.world + self.rank, values.tolist()) for i, values in enumerate(local)]
        return [v for _, values in sorted(self.gather(mine)) for v in values]


def output_step(
    model: torch.nn.Module | None,
    choices: Choices,
    rows: list[tuple[int, ...]],
    target: fp8.Target,
    compute: ComputePath,
    pad: int,
    device: torch.device,
    forwards_allowed: int,
    headroom: float = 1.0,
    rank: int = 0,
    world: int = 1,
    gather: Gather = lambda local: local,
) -> tuple[Choices, StepReport]:
    """`choices` with the material layer-kinds settled by the output (module docstring), and what the step did
    (`model` None: the whole model does not fit, nothing settled)."""
    kinds = [
        (i, kind) for i, layer in enumerate(choices) for kind in range(2) if layer[kind].material
    ]
    if not kinds:
        return choices, StepReport(
            material=0, budget=forwards_allowed, skipped="no layer's candidates differ materially"
        )
    if model is None:
        return choices, StepReport(
            material=len(kinds),
            budget=forwards_allowed,
            skipped="it runs the whole model, which does not fit in memory here",
        )
    if len(rows) < MIN_ROWS:
        return choices, StepReport(
            material=len(kinds),
            budget=forwards_allowed,
            skipped=f"{len(rows)} held-out calibration row(s); it needs {MIN_ROWS} (--num-samples)",
        )
    scorer = _Scorer(model, rows, target, compute, pad, device, rank, world, gather)
    weighed = _weighed(choices, kinds, forwards_allowed - 2)
    state = [[choice.index for choice in layer[:2]] for layer in choices]
    start = current = scorer.kl(_quantizer(choices, state, target, headroom))
    out, forwards, total = (
        list(choices),
        2,
        math.fsum(scorer.tokens),
    )  # the reference, and the objective's choices
    for i, kind in sorted(weighed):
        choice, cands = choices[i][kind], choices[i][kind + 2]
        costs, written = {choice.index: current}, {_key(choice.index, cands, headroom, target)}
        for index in choice.shortlist:
            key = _key(index, cands, headroom, target)
            if key not in written:  # --headroom can make two candidates one
                written.add(key)
                state[i][kind] = index
                costs[index] = scorer.kl(_quantizer(choices, state, target, headroom))
                forwards += 1
        state[i][kind] = pick = decide(costs, scorer.tokens, cands, choice.index)
        current = costs[pick]
        record = choice.rechosen(
            pick,
            cands.labels,
            tuple((_label(index, cands), math.fsum(c) / total) for index, c in costs.items()),
        )
        out[i] = (record, out[i][1], *out[i][2:]) if kind == 0 else (out[i][0], record, *out[i][2:])
    report = StepReport(
        rows=len(rows),
        tokens=int(total),
        material=len(kinds),
        weighed=len(weighed),
        changed=sum(o[k].index != c[k].index for o, c in zip(out, choices) for k in range(2)),
        forwards=forwards,
        budget=forwards_allowed,
        kl_before=math.fsum(start) / total,
        kl_after=math.fsum(current) / total,
    )
    if report.changed and _worse(
        current, start, scorer.tokens
    ):  # ties that add up to worse: keep the objective's
        return choices, replace(
            report,
            changed=0,
            kl_after=report.kl_before,
            skipped=f"its changes together were worse (KL {report.kl_after:.3g}) than none",
        )
    return out, report


def _weighed(
    choices: Choices, kinds: list[tuple[int, int]], forwards: int
) -> list[tuple[int, int]]:
    """The material kinds the budget allows: those with a clip on the table first, then the largest attention error
    absmax would cost (where a scale matters most)."""
    out = []
    for i, kind in sorted(
        kinds,
        key=lambda ik: (
            not choices[ik[0]][ik[1]].clip_on_table,
            -choices[ik[0]][ik[1]].error_absmax,
            ik,
        ),
    ):
        cost = len(choices[i][kind].shortlist) - 1
        if cost <= forwards:
            out.append((i, kind))
            forwards -= cost
    return out


def decide(
    costs: dict[tuple[int, ...], list[float]],
    tokens: list[float],
    cands: Candidates,
    chosen: tuple[int, ...],
) -> tuple[int, ...]:
    """The lowest mean KL; among those indistinguishable from it (paired interval over rows reaching 0), the least
    clipping, then the objective's own (`chosen`)."""
    finite = [index for index in costs if all(map(math.isfinite, costs[index]))]
    if chosen not in finite:
        finite.append(chosen)  # nothing finite beats it: the objective's own stands
    best = min(finite, key=lambda index: (math.fsum(costs[index]), index != chosen))

    def ties(index: tuple[int, ...]) -> bool:
        return index == best or not _worse(costs[index], costs[best], tokens)

    return max(
        (index for index in finite if ties(index)),
        key=lambda index: (_kept(index, cands), index == chosen),
    )


def _worse(costs: list[float], than: list[float], tokens: list[float]) -> bool:
    """`costs` worse than `than` beyond the noise: the paired interval over rows of the difference is above 0."""
    interval = paired_bootstrap([a - b for a, b in zip(costs, than)], tokens)
    return interval is not None and interval.low > 0.0


def _kept(index: tuple[int, ...], cands: Candidates) -> float:
    """How much of absmax's range the candidate keeps, summed over heads (the least clipping: the most)."""
    heads = range(cands.ranges.shape[1])
    per_head = index * len(heads) if len(index) == 1 else index
    return math.fsum(
        min(float(cands.ranges[c, h]), float(cands.ranges[0, h])) for h, c in zip(heads, per_head)
    )


def _label(index: tuple[int, ...], cands: Candidates) -> str:
    labels = {cands.labels[c] for c in index}
    return (
        labels.pop() if len(labels) == 1 else "per head " + ",".join(cands.labels[c] for c in index)
    )


def _key(
    index: tuple[int, ...], cands: Candidates, headroom: float, target: fp8.Target
) -> tuple[float, ...]:
    """The scales the candidate writes, per head, as calibration.scales.layer_scales writes them (--headroom)."""
    per_head = index * cands.scales.shape[1] if len(index) == 1 else index
    scales = torch.stack([cands.scales[c, h] for h, c in enumerate(per_head)])
    return tuple(with_headroom(scales, cands.ranges[0], headroom, target).tolist())


def _quantizer(
    choices: Choices, state: list[list[tuple[int, ...]]], target: fp8.Target, headroom: float
) -> KVQuantizer:
    def scale(index: tuple[int, ...], cands: Candidates) -> Scale:
        written = _key(index, cands, headroom, target)
        return written[0] if len(index) == 1 else head_scale(list(written))

    return KVQuantizer(
        [scale(state[i][0], layer[2]) for i, layer in enumerate(choices)],
        [scale(state[i][1], layer[3]) for i, layer in enumerate(choices)],
        target,
    )
