"""Each layer's contribution to ΔNLL: the model run with only that layer's K/V in FP8.

A per-layer error figure (SQNR, attention error) says how far the values move, not what that costs the prediction
(a near-constant K channel can make SQNR rank scales backwards). This scores NLL and KL (the steadier on few tokens)
one layer at a time (evaluation.pipeline), on the first `EvalOptions.layer_rows` rows; layers interact, so these need
not add up."""

from __future__ import annotations

from typing import Any

import torch

from kvcalib.evaluation.emulate import KVQuantizer

__all__ = ["OneLayer"]


class OneLayer:
    """An attention hook: `quantizer` on one layer's K/V only (`layer` None: on none, the unquantised reference)."""

    def __init__(self, quantizer: KVQuantizer | None, layer: int | None) -> None:
        self.quantizer, self.layer = quantizer, layer

    def observe(
        self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.quantizer.observe(layer_idx, key, value) if layer_idx == self.layer else None
