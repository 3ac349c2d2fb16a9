"""Next-token scoring as eval, its per-layer runs and eval-context do it: the model's log-probabilities
with a hook on its K/V (which predictions count, and their KL: evaluation.pipeline)."""

from __future__ import annotations

from typing import Any

import torch

from kvcalib.core.cpu import ComputePath
from kvcalib.hf.attention import observed_forward, observing_attention
from kvcalib.hf.compute import Float32Weights, compute_path

__all__ = ["log_probs"]


@torch.inference_mode()
def log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    hook: Any,
    *,
    compute: ComputePath,
    weights: Float32Weights | None = None,
    keep: int = 0,
) -> torch.Tensor:
    """Next-token log-probabilities [B, S-1, V] in float32, with `hook` (None: none) on every layer's K/V (`keep`: of
    the last keep - 1 tokens only, [B, keep - 1, V]; asked of the model only then: remote code may not know
    logits_to_keep)."""
    with compute_path(compute, weights), observing_attention(model, hook):
        kwargs = {"logits_to_keep": keep} if keep else {}
        logits = observed_forward(model, input_ids, mask, hook and hook.observe, **kwargs).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1)
