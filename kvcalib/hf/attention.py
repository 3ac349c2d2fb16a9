"""Observe the K and V that attention writes to its KV cache, through transformers' attention interface.

kvcalib registers an attention implementation (`kvcalib_sdpa`) that records per-layer
absmax of K and V, then runs transformers' own SDPA attention. A model's attention module
calls it with `key`/`value` exactly as it would hand them to the cache: after rotary
embedding (and after k-norm where a model has one), before the grouped-query repeat,
shape `[batch, kv_heads, seq, head_dim]`. No model forward is copied and nothing is
fake-quantised.

An observer's `observe(layer_idx, key, value)` may return replacement (key, value): that
is how kvcalib.emulate runs attention on an FP8-quantised KV cache.

The observer reaches the attention function as a forward keyword argument, which
transformers passes through to every attention call, so there is no global state.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcalib.core.errors import UnsupportedModelError

__all__ = [
    "ATTN_IMPLEMENTATION", "KVAbsmaxObserver", "OBSERVER_KWARG", "StopForward", "attention_modules",
    "observe_batch", "register_attention",
]

ATTN_IMPLEMENTATION = "kvcalib_sdpa"
OBSERVER_KWARG = "kvcalib_observer"


class StopForward(Exception):
    """Raised after the last layer's K/V are recorded: nothing after it is needed."""


class KVAbsmaxObserver:
    """Running absmax of K and V per decoder layer, kept on the model's device.

    `token_mask` ([batch, seq] bool, True for real tokens) must be set before each forward
    so that padding positions never reach the statistics.
    """

    def __init__(self, num_layers: int, device: torch.device | str = "cpu") -> None:
        self.num_layers = num_layers
        self.k_absmax = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.v_absmax = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.observed = [0] * num_layers  # forward calls that reached each layer
        self.token_mask: torch.Tensor | None = None

    def observe(self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise UnsupportedModelError(
                f"an attention layer reported layer_idx {layer_idx!r}, outside the model's {self.num_layers} layers",
                hint="kvcalib needs attention modules numbered 0..num_hidden_layers-1 (transformers' layer_idx)",
            )
        # key, value: [B, H_kv, S, D] -> per-token absmax [B, S] (NaN/inf propagate on purpose)
        k_tok = key.detach().abs().amax(dim=(1, 3)).float()
        v_tok = value.detach().abs().amax(dim=(1, 3)).float()
        mask = self.token_mask
        if mask is not None:
            if mask.shape != k_tok.shape:
                raise RuntimeError(
                    f"layer {layer_idx}: K/V cover {tuple(k_tok.shape)} tokens but the batch mask is {tuple(mask.shape)}"
                )
            k_tok = k_tok.masked_fill(~mask, 0.0)
            v_tok = v_tok.masked_fill(~mask, 0.0)
        self.k_absmax[layer_idx] = torch.maximum(self.k_absmax[layer_idx], k_tok.max())
        self.v_absmax[layer_idx] = torch.maximum(self.v_absmax[layer_idx], v_tok.max())
        self.observed[layer_idx] += 1
        if layer_idx == self.num_layers - 1:
            raise StopForward


def _observing_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observer = kwargs.pop(OBSERVER_KWARG, None)
    if observer is not None:
        # An observer may also replace K/V (kvcalib.emulate quantises them as the chip would).
        replaced = observer.observe(getattr(module, "layer_idx", None), key, value)
        if replaced is not None:
            key, value = replaced
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> str:
    """Register kvcalib's observing attention (and SDPA's mask builder) under one name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _observing_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def attention_modules(model: torch.nn.Module, num_layers: int, where: object) -> dict[int, str]:
    """layer index -> state-dict path of the attention module that owns that layer's KV cache.

    Every layer 0..num_layers-1 must have one; UnsupportedModelError (naming `where`) otherwise.
    """
    found: dict[int, str] = {}
    for name, module in model.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            found.setdefault(layer_idx, name)
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise UnsupportedModelError(
            f"{where}: no attention module with k_proj/v_proj found for layer(s) {missing}",
            hint="kvcalib observes attention modules that call transformers' attention interface",
        )
    return found


@torch.inference_mode()
def observe_batch(decoder: torch.nn.Module, observer: KVAbsmaxObserver, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> None:
    """Run one right-padded batch through the decoder stack (no LM head), recording K/V absmax.

    With right padding every real token keeps the positions (and so the rotary phases) it
    has when run alone, and causal attention never lets it see the padding after it.
    """
    observer.token_mask = attention_mask.bool()
    try:
        decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                **{OBSERVER_KWARG: observer})
    except StopForward:
        pass
    finally:
        observer.token_mask = None
