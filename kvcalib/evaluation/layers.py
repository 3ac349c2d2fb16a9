"""Each layer's contribution to ΔNLL: the model run with only that layer's K/V in FP8.

A per-layer error figure (SQNR, attention error) says how far the values move, not what that costs the prediction
(a near-constant K channel can make SQNR rank scales backwards). This scores NLL and KL (the steadier on few tokens)
one layer at a time, on the first `EvalOptions.layer_rows` rows; layers interact, so these need not add up."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.evaluation.emulate import FreshPrefill, KVQuantizer
from kvcalib.evaluation.scoring import scored_tokens, token_kl
from kvcalib.hf.data import batches

__all__ = ["LayerAlone", "OneLayer", "layers_alone"]


class OneLayer:
    """An attention hook: `quantizer` on one layer's K/V only (`layer` None: on none, the unquantised reference)."""

    def __init__(self, quantizer: KVQuantizer | None, layer: int | None) -> None:
        self.quantizer, self.layer = quantizer, layer

    def observe(
        self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.quantizer.observe(layer_idx, key, value) if layer_idx == self.layer else None


LogProbs = Callable[
    [torch.Tensor, torch.Tensor, Any], torch.Tensor
]  # (input_ids, mask, hook) -> [B, S-1, V]


@dataclass(frozen=True)
class LayerAlone:
    """One layer quantised alone: ΔNLL and KL(unquantised || quantised), means over the scored tokens."""

    delta_nll: float
    kl: float


def layers_alone(
    log_probs: LogProbs,
    sequences: Sequence[Sequence[int]],
    batch_size: int,
    pad: int,
    device: torch.device,
    quantizers: dict[str, KVQuantizer],
    notify: ProgressCallback = no_progress,
    fresh_prefill: bool = False,
) -> dict[str, list[LayerAlone | None]]:
    """name -> per layer, ΔNLL and KL with only that layer quantised (FP8 attention: None; no rows: {})."""
    if not sequences:
        return {}
    notify(Progress("layers-alone"))
    kv_only = {name: q for name, q in quantizers.items() if not q.fp8_attention}
    num_layers = next(iter(quantizers.values())).num_layers
    sums = {
        name: torch.zeros(num_layers, 2, dtype=torch.float64) for name in kv_only
    }  # [layer, (nll, kl)]
    base_sum, count = 0.0, 0
    for input_ids, mask in batches(list(sequences), batch_size, pad):
        input_ids, mask = input_ids.to(device), mask.to(device)
        scored = scored_tokens(mask, fresh_prefill)
        targets = input_ids[:, 1:, None]
        base = log_probs(input_ids, mask, OneLayer(None, None))
        base_sum += (-base.gather(-1, targets)[..., 0][scored]).double().sum().item()
        count += int(scored.sum())
        for name, quantizer in kv_only.items():
            for layer in range(num_layers):
                hook = OneLayer(quantizer, layer)
                logp = log_probs(
                    input_ids, mask, FreshPrefill(hook, mask) if fresh_prefill else hook
                )
                nll = (-logp.gather(-1, targets)[..., 0][scored]).double().sum()
                kl = token_kl(base, logp)[scored].double().sum()
                sums[name][layer] += torch.stack([nll, kl]).cpu()
    n = max(count, 1)
    return {
        name: [
            LayerAlone(delta_nll=(nll - base_sum) / n, kl=kl / n) for nll, kl in sums[name].tolist()
        ]
        if name in sums
        else [None] * num_layers
        for name in quantizers
    }
