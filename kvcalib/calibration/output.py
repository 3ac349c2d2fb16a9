"""The whole-model step: the attention objective's close calls settled by what the model outputs.

The attention objective scores each layer alone, and its pick rule (the least clipping within 25 % of the best)
cannot see that the cost at the output is not monotone in the clip: a near-constant K channel flips on FP8 rounding
boundaries at one scale and saturates (constant, ignored by softmax) at a deeper one. So where a layer's candidates
differ materially (close_call: a clip is on the table, or the best beats the pick by a tenth), its shortlist (the
objective's pick, the SHORTLIST lowest attention errors, absmax) is scored by the model itself: next-token KL
against the unquantised cache on TOKENS of held-out calibration rows (never the objective's), every other layer at
its current choice, as written (--headroom; with --attention-scales, Q in FP8 too), in the target's numerics and its
server's order (Neuron: a fresh-K/V prefill of each row's first half, then decode steps reading FP8;
emulate.FreshPrefill). A coordinate pass in layer order: an early layer's change moves every later layer's inputs,
so later layers are weighed against the early layers' settled choices.

The lowest mean KL wins; candidates whose cost is indistinguishable from it (the paired interval over rows of the
difference reaches 0) tie, and of those the least clipping wins, then the objective's own; a cost not finite on a
row neither wins nor ties. The pass runs at most `budget` forwards (BUDGET_SHARE of the calibration's tokens,
MIN_FORWARDS at least): the material kinds with a clip on the table first, then those where absmax's attention error
is largest. The candidates go through the layers side by side, one layer at a time (output_step): the same in memory
and streamed from the checkpoint. Under torchrun the rows' batches are shared round-robin and every row's sum
gathered: each rank decides as one process does, to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvcalib.calibration.objective import (
    GAIN,
    OUTPUT,
    WIDER_GAIN,
    Candidates,
    Gather,
    Pick,
    Scored,
    worst,
)
from kvcalib.calibration.options import StepReport
from kvcalib.calibration.scales import written_scales
from kvcalib.calibration.stream import LayerStream, capture_layer_inputs
from kvcalib.core import fp8
from kvcalib.core.cpu import ComputePath
from kvcalib.evaluation.emulate import FreshPrefill, KVQuantizer, Scale, head_scale
from kvcalib.evaluation.layers import OneLayer
from kvcalib.evaluation.scoring import row_sums, scored_tokens, token_kl
from kvcalib.evaluation.significance import paired_bootstrap
from kvcalib.hf.attention import ObservedCache, observing_attention
from kvcalib.hf.compute import Float32Weights, compute_path
from kvcalib.hf.data import batches
from kvcalib.hf.internals import cache_kwargs

__all__ = [
    "BUDGET_SHARE",
    "MAX_PASSES",
    "MIN_FORWARDS",
    "OUTPUT",
    "ROW_TOKENS",
    "SHORTLIST",
    "TOKENS",
    "StepReport",
    "budget",
    "close_call",
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
MAX_PASSES = 3  # over the layers (streamed: each reads the weights from the first changed layer on)
SHORTLIST = 2  # the lowest attention errors the step weighs, beside the objective's pick and absmax
TOP = 1024  # KL over the reference's TOP most likely tokens and the rest lumped (a lower bound of the full KL)
LOGIT_BYTES = 64 << 20  # the log-probabilities one step batch may hold

Layers = Sequence[
    tuple[Scored, Scored]
]  # per layer: K and V as the attention objective scored them
Shortlist = tuple[tuple[int, ...], ...]  # per-head candidate indices (one entry per tensor)


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


Branch = tuple[
    int, KVQuantizer | None
]  # (the layer it leaves the base at, its K/V quantizer; None: unquantised)
BASE, REFERENCE = "base", "reference"


class _Switch:
    """The attention hook of whichever branch is going through the layer: set before each call."""

    hook: Any = None

    def observe(self, *args: Any) -> Any:
        return self.hook.observe(*args)


@dataclass
class _Scorer:
    """Per-row KL sums of the model's next-token distributions against the unquantised run's, for branches that go
    through the decoder layers side by side, one layer at a time (each layer loaded once a pass when streamed)."""

    stream: LayerStream
    rows: list[tuple[int, ...]]
    target: fp8.Target
    compute: ComputePath
    pad: int
    device: torch.device
    rank: int = 0
    world: int = 1
    gather: Gather = lambda local: local

    def __post_init__(self) -> None:
        self.stream.load_head()
        vocab = int(self.stream.model.get_output_embeddings().weight.shape[0])
        size = max(1, LOGIT_BYTES // (4 * vocab * max(len(r) for r in self.rows)))
        shares = enumerate(batches(tuple(self.rows), size, self.pad))
        self.batches = [
            (ids.to(self.device), mask.to(self.device))
            for i, (ids, mask) in shares
            if i % self.world == self.rank
        ]
        self.fresh = self.target.order == fp8.NEURON_ORDER
        self.head_weights = Float32Weights()
        self.reference: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.tokens: list[float] = []

    def _hook(self, quantizer: KVQuantizer | None, mask: torch.Tensor) -> Any:
        if quantizer is None:
            return OneLayer(None, None)
        return FreshPrefill(quantizer, mask) if self.fresh else quantizer

    def run(
        self, start: int, inputs: list[torch.Tensor] | None, branches: dict[Any, Branch]
    ) -> tuple[dict[Any, list[float]], dict[int, list[torch.Tensor]]]:
        """Every row's summed KL per branch (rows in the single process's order), each branch the BASE's hidden
        states up to its layer, its own after; `inputs`: the BASE's at layer `start` (None: from the embeddings,
        and REFERENCE, the unquantised run, among the branches). Also the BASE's hidden states at each branch's
        layer."""
        stream, switch, hidden = self.stream, _Switch(), {name: [] for name in branches}
        saved: dict[int, list[torch.Tensor]] = {}
        with torch.inference_mode():
            for i in range(start, len(stream.layers)):
                if any(at == i for at, _ in branches.values()):
                    saved[i] = []  # (none where this rank has no batch)
                with stream.layer(i) as layer, compute_path(self.compute, Float32Weights()):
                    for b, (ids, mask) in enumerate(self.batches):
                        first, args, kwargs = capture_layer_inputs(
                            stream.decoder, stream.layers, i, ids, mask, switch
                        )
                        if i == start:
                            base = first if inputs is None else inputs[b]
                            for name in branches:
                                hidden[name].append(base)
                        for name, (at, _) in branches.items():
                            if at == i and i > start:
                                hidden[name][b] = hidden[BASE][b]
                        if i in saved:
                            saved[i].append(hidden[BASE][b])
                        for name, (at, quantizer) in branches.items():
                            if at <= i:
                                switch.hook = hook = self._hook(quantizer, mask)
                                with observing_attention(stream.model, hook):
                                    out = layer(hidden[name][b], *args, **kwargs)
                                hidden[name][b] = out[0] if isinstance(out, tuple) else out
            sums: dict[Any, list[torch.Tensor]] = {
                name: [] for name in branches if name != REFERENCE
            }
            for b, (ids, mask) in enumerate(self.batches):
                if REFERENCE in branches:
                    logp = self._log_probs(hidden[REFERENCE][b], ids, mask)
                    top, index = logp.topk(min(TOP, logp.shape[-1]), dim=-1)
                    self.reference.append((_lumped(top), index, scored_tokens(mask, self.fresh)))
                ref, index, scored = self.reference[b]
                for name in sums:
                    logq = self._log_probs(hidden[name][b], ids, mask)
                    sums[name].append(
                        row_sums(token_kl(ref, _lumped(logq.gather(-1, index))), scored)
                    )
        if REFERENCE in branches:
            self.tokens = self._gathered(
                [scored.sum(dim=1).double() for _, _, scored in self.reference]
            )
        return {name: self._gathered(values) for name, values in sums.items()}, saved

    def _log_probs(
        self, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The model's next-token log-probabilities from the last layer's output `hidden` (its norm and head)."""
        layers = self.stream.layers
        for i, layer in enumerate(layers):
            layer.forward = _passes(hidden if i == len(layers) - 1 else None)
        try:
            with compute_path(self.compute, self.head_weights):
                logits = self.stream.model(
                    input_ids=ids,
                    attention_mask=mask,
                    use_cache=True,
                    **cache_kwargs(
                        self.stream.model,
                        ObservedCache(self.stream.model.config, store=False),
                    ),
                ).logits
        finally:
            for layer in layers:
                vars(layer).pop("forward", None)
        return torch.log_softmax(logits[:, :-1].float(), dim=-1)

    def _gathered(self, local: list[torch.Tensor]) -> list[float]:
        """Per-batch row values from every rank, back in the single process's batch order."""
        mine = [(i * self.world + self.rank, values.tolist()) for i, values in enumerate(local)]
        return [v for _, values in sorted(self.gather(mine)) for v in values]


def _passes(out: torch.Tensor | None) -> Any:
    """A decoder layer's stand-in: returns `out`, or (None) the hidden states it is given."""

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return out if out is not None else args[0] if args else kwargs["hidden_states"]

    return forward


def close_call(scored: Scored) -> tuple[Shortlist, bool] | None:
    """Where the candidates differ materially (a clip is on the table: one at least halves absmax's error, GAIN, on
    both halves; or the best beats the pick by a tenth, WIDER_GAIN), what the step weighs: the pick, the SHORTLIST
    lowest attention errors and absmax, and whether a clip is on the table; None elsewhere. Over the candidates
    scored in full: absmax, 1.0 and those that cut absmax's error as a pick needs (GAIN, WIDER_GAIN for a wider
    scale); the others stopped early."""
    choosing, cands, kept = scored.choosing, scored.candidates, scored.index
    errors, held_errors = (
        worst(choosing.sum(dim=2, keepdim=True)),
        worst(scored.held.sum(dim=2, keepdim=True)),
    )
    keeps = cands.keeps_range.all(dim=1).tolist()

    def cuts(c: int) -> bool:
        gain = WIDER_GAIN if keeps[c] else GAIN
        return errors[c] < gain**2 * errors[0] and held_errors[c] < gain**2 * held_errors[0]

    full = [c for c in range(len(errors)) if c in (0, cands.unit) or cuts(c)]
    ranked = sorted(full, key=lambda c: (errors[c] + held_errors[c], c))[:SHORTLIST]
    best = min(full, key=lambda c: (errors[c], c))
    picked = max(
        math.fsum(choosing[n, c, h].item() for h, c in enumerate(scored.per_head(kept)))
        for n in range(len(choosing))
    )
    gap = picked / errors[best] if errors[best] > 0 else 1.0  # squared, choosing rows
    clip_on_table = any(not keeps[c] and cuts(c) for c in range(1, len(errors)))
    if not (clip_on_table or gap * WIDER_GAIN**2 > 1.0):
        return None
    shortlist = dict.fromkeys([kept, *((c,) * len(kept) for c in ranked), (0,) * len(kept)])
    return tuple(shortlist), clip_on_table


def output_step(
    stream: LayerStream,
    layers: Layers,
    sequences: Sequence[Sequence[int]],
    sampled: frozenset[tuple[int, ...]],
    target: fp8.Target,
    compute: ComputePath,
    pad: int,
    device: torch.device,
    headroom: float = 1.0,
    q_scales: list[Scale] | None = None,
    rank: int = 0,
    world: int = 1,
    gather: Gather = lambda local: local,
) -> tuple[list[list[Pick]], StepReport]:
    """Per layer, K and V as written: the objective's picks with its close calls (close_call) settled by the
    output on held-out calibration rows (`sequences` less `sampled`, the objective's), and what the step did.
    `q_scales`: the Q scales written (--attention-scales): the candidates are weighed under FP8 attention.

    The candidates go through the layers side by side with the current choices (BASE), each from its own layer on:
    one pass over the layers weighs every close call whose earlier ones keep their pick. Where one changes, the
    layers from its layer on run again for the close calls after it, from the BASE's saved hidden states there
    (the settled prefix is not recomputed): passes = 1 + the changes before the last close call, at most
    MAX_PASSES; the close calls a change leaves after the last pass keep the objective's pick."""
    picks = [[scored.pick() for scored in layer] for layer in layers]
    calls = {
        (i, kind): call
        for i, layer in enumerate(layers)
        for kind, scored in enumerate(layer)
        if (call := close_call(scored)) is not None
    }
    rows = held_out_rows(sequences, sampled)
    allowed = budget(sum(map(len, sequences)), sum(map(len, rows)))
    skipped = (
        "no layer's candidates differ materially"
        if not calls
        else f"{len(rows)} held-out calibration row(s); it needs {MIN_ROWS} (--num-samples)"
        if len(rows) < MIN_ROWS
        else None
    )
    if skipped:
        return picks, StepReport(material=len(calls), budget=allowed, skipped=skipped)
    scorer = _Scorer(stream, rows, target, compute, pad, device, rank, world, gather)
    weighed = _weighed(layers, calls, allowed - 2)
    state = [[scored.index for scored in layer] for layer in layers]
    pending, start, inputs, first = sorted(weighed), 0, None, True
    forwards = passes = unweighed = changed = 0
    unscored: list[str] = []
    while first or pending:
        branches = _branches(
            layers, calls, state, pending, start, first, target, headroom, q_scales
        )
        sums, saved = scorer.run(start, inputs, branches)
        forwards, passes = forwards + len(branches), passes + 1
        current = sums[BASE]
        if first:
            start_costs, total, first = current, math.fsum(scorer.tokens), False
        for n, (i, kind) in enumerate(pending):
            scored = layers[i][kind]
            costs = {scored.index: current} | {
                name[2]: sums[name] for name in branches if name[:2] == (i, kind)
            }
            state[i][kind] = pick = decide(costs, scorer.tokens, scored.candidates, scored.index)
            if not any(map(_finite, costs.values())):
                unscored.append(f"layer {i} {'KV'[kind]}")
            picks[i][kind] = scored.pick(pick, OUTPUT, _record(costs, scored.candidates, total))
            if pick != scored.index:  # the layers after it run again, from its layer's input
                current, pending, start, inputs = costs[pick], pending[n + 1 :], i, saved[i]
                changed += 1
                break
        else:
            pending = []
        if passes == MAX_PASSES:  # the close calls left keep the objective's pick
            unweighed, pending = len(pending), []
    report = StepReport(
        rows=len(rows),
        tokens=int(total),
        material=len(calls),
        weighed=len(weighed) - unweighed,
        changed=changed,
        forwards=forwards,
        passes=passes,
        budget=allowed,
        kl_before=math.fsum(start_costs) / total,
        kl_after=math.fsum(current) / total,
        non_finite=tuple(unscored) or None,
    )
    if report.changed and _worse(current, start_costs, scorer.tokens):
        # ties that add up to worse: keep the objective's
        return [[scored.pick() for scored in layer] for layer in layers], replace(
            report,
            changed=0,
            kl_after=report.kl_before,
            skipped=f"its changes together were worse (KL {report.kl_after:.3g}) than none",
        )
    return picks, report


def _branches(
    layers: Layers,
    calls: dict[tuple[int, int], tuple[Shortlist, bool]],
    state: list[list[tuple[int, ...]]],
    pending: list[tuple[int, int]],
    start: int,
    first: bool,
    target: fp8.Target,
    headroom: float,
    q_scales: list[Scale] | None,
) -> dict[Any, Branch]:
    """A pass's branches: the BASE (the current choices) from `start`, the REFERENCE on the `first`, and each pending
    close call's candidates against the settled choices before it, from its layer on (one per scale written:
    --headroom can make two candidates one)."""
    branches: dict[Any, Branch] = {
        BASE: (start, _quantizer(layers, state, target, headroom, q_scales))
    }
    if first:
        branches[REFERENCE] = (0, None)
    for i, kind in pending:
        cands = layers[i][kind].candidates
        written = {_key(state[i][kind], cands, headroom, target)}
        for index in calls[i, kind][0]:
            key = _key(index, cands, headroom, target)
            if key not in written:
                written.add(key)
                trial = [list(kinds) for kinds in state]
                trial[i][kind] = index
                branches[i, kind, index] = (
                    i,
                    _quantizer(layers, trial, target, headroom, q_scales),
                )
    return branches


def _weighed(
    layers: Layers, calls: dict[tuple[int, int], tuple[Shortlist, bool]], forwards: int
) -> list[tuple[int, int]]:
    """The close calls the budget allows: those with a clip on the table first, then the largest attention error
    absmax would cost (where a scale matters most)."""
    out = []
    for i, kind in sorted(
        calls, key=lambda ik: (not calls[ik][1], -layers[ik[0]][ik[1]].error_absmax, ik)
    ):
        cost = len(calls[i, kind][0]) - 1
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
    clipping, then the objective's own (`chosen`). A candidate with a non-finite cost on any row neither wins nor
    ties; where none is finite, `chosen`."""
    finite = [index for index in costs if _finite(costs[index])]
    if not finite:
        return chosen  # nothing finite: the objective's own stands (output_step reports it)
    best = min(finite, key=lambda index: (math.fsum(costs[index]), index != chosen))

    def ties(index: tuple[int, ...]) -> bool:
        return index == best or not _worse(costs[index], costs[best], tokens)

    return max(
        (index for index in finite if ties(index)),
        key=lambda index: (_kept(index, cands), index == chosen),
    )


def _finite(costs: list[float]) -> bool:
    return all(map(math.isfinite, costs))


def _worse(costs: list[float], than: list[float], tokens: list[float]) -> bool:
    """`costs` worse than `than` beyond the noise: not finite on some row, or the paired interval over rows of the
    difference above 0."""
    if not _finite(costs):
        return True
    interval = paired_bootstrap([a - b for a, b in zip(costs, than)], tokens)
    return interval is not None and interval.low > 0.0


def _kept(index: tuple[int, ...], cands: Candidates) -> float:
    """How much of absmax's range the candidate keeps, summed over heads (the least clipping: the most)."""
    heads = range(cands.ranges.shape[1])
    per_head = index * len(heads) if len(index) == 1 else index
    return math.fsum(
        min(float(cands.ranges[c, h]), float(cands.ranges[0, h])) for h, c in zip(heads, per_head)
    )


def _record(
    costs: dict[tuple[int, ...], list[float]], cands: Candidates, total: float
) -> tuple[tuple[str, float], ...]:
    """Each candidate weighed and its mean next-token KL, as ScaleChoice.output records them."""
    return tuple((_label(index, cands), math.fsum(c) / total) for index, c in costs.items())


def _label(index: tuple[int, ...], cands: Candidates) -> str:
    labels = {cands.labels[c] for c in index}
    return (
        labels.pop() if len(labels) == 1 else "per head " + ",".join(cands.labels[c] for c in index)
    )


def _key(
    index: tuple[int, ...], cands: Candidates, headroom: float, target: fp8.Target
) -> tuple[float, ...]:
    """The scales the candidate writes (per head, or one per tensor), as layer_scales writes them: written_scales."""
    per_head = index * cands.scales.shape[1] if len(index) == 1 else index
    scales = torch.stack([cands.scales[c, h] for h, c in enumerate(per_head)])
    return tuple(written_scales(scales, cands.ranges[0], headroom, target, len(index) > 1).tolist())


def _quantizer(
    layers: Layers,
    state: list[list[tuple[int, ...]]],
    target: fp8.Target,
    headroom: float,
    q_scales: list[Scale] | None = None,
) -> KVQuantizer:
    """The K/V scales `state` writes; with `q_scales` (those written), FP8 attention."""
    k, v = (
        [
            head_scale(list(_key(state[i][kind], layer[kind].candidates, headroom, target)))
            for i, layer in enumerate(layers)
        ]
        for kind in range(2)
    )
    return KVQuantizer(k, v, target, q_scales, fp8_attention=q_scales is not None)


def _lumped(top: torch.Tensor) -> torch.Tensor:
    """[..., TOP] log-probabilities and one more: the rest of the distribution, lumped."""
    return torch.cat([top, torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))[..., None]], dim=-1)
