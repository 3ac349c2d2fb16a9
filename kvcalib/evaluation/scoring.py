"""Next-token scoring as eval and its per-layer runs (layers.py) do it: the model's
log-probabilities with a hook on its K/V, which predictions are scored, and the KL against a reference run."""

from __future__ import annotations

from typing import Any

import torch

from kvcalib.core.cpu import ComputePath
from kvcalib.evaluation.emulate import decode_rows
from kvcalib.hf.attention import ObservedCache, observing_attention
from kvcalib.hf.compute import Float32Weights, compute_path
from kvcalib.hf.internals import cache_kwargs

__all__ = ["log_probs", "row_sums", "scored_tokens", "token_kl"]


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
    """Next-token log-probabilities [B, S-1, V] in float32, with `hook` on every layer's K/V (`keep`: of the last
    keep - 1 tokens only, [B, keep - 1, V]; asked of the model only then: remote code may not know logits_to_keep)."""
    with compute_path(compute, weights), observing_attention(model, hook):
        logits = model(
            input_ids=input_ids,
            attention_mask=mask,
            use_cache=True,
            **cache_kwargs(model, ObservedCache(model.config, hook.observe, store=False)),
            **({"logits_to_keep": keep} if keep else {}),
        ).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1)


def scored_tokens(mask: torch.Tensor, fresh_prefill: bool) -> torch.Tensor:
    """[B, S-1] bool: the predictions scored, of a real token from a real token; in Neuron's order
    (`fresh_prefill`) only the decode steps (emulate.decode_rows)."""
    scored = (mask[:, 1:] & mask[:, :-1]).bool()
    return scored & decode_rows(mask)[:, :-1] if fresh_prefill else scored


def token_kl(reference: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(reference || logp) per position, from log-probabilities over the last dimension."""
    return (reference.exp() * (reference - logp)).sum(-1)


def row_sums(values: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """[B, S] per-token values -> [B] float64 sums over the scored tokens."""
    return torch.where(scored, values.double(), 0.0).sum(dim=1)
