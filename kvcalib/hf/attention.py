"""Observe the K and V each attention layer writes to its KV cache, by being that cache.

kvcalib hands the decoder a `RecordingCache` as `past_key_values`. Every attention module
of every transformers family calls `past_key_values.update(key, value, layer_idx)` with
exactly what it stores: K after rotary embedding (and after k-norm where a model has one),
V as is, before the grouped-query repeat, shape `[batch, kv_heads, seq, head_dim]`. The
cache records them and hands them straight back, storing nothing (a calibration forward is
one prefill). The model then runs its own attention, whatever it is (SDPA, eager with
attention sinks as in GPT-OSS, soft-capping as in Gemma2, sliding windows): nothing of it is
replaced, copied or fake-quantised.

An observer's `observe(layer_idx, key, value)` may return replacement (key, value): that is
how kvcalib.evaluate runs attention on an FP8-quantised KV cache. The observer lives in the
cache object made for each forward, so there is no global state.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvcalib.core.errors import UnsupportedModelError

__all__ = ["KVAbsmaxObserver", "RecordingCache", "StopForward", "attention_modules", "observe_batch"]


class RecordingCache(DynamicCache):
    """A DynamicCache for one prefill forward whose `update` shows K/V to an observer and stores nothing.

    Built from the model's config, so masks, sliding windows and layer types come out as the
    model's own cache would make them; only `update` differs.
    """

    def __init__(self, config: Any, observer: Any) -> None:
        super().__init__(config=config)
        self.observer = observer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        replaced = self.observer.observe(layer_idx, key_states, value_states)
        return replaced if replaced is not None else (key_states, value_states)


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


def attention_modules(model: torch.nn.Module, num_layers: int, where: object) -> dict[int, str]:
    """layer index -> state-dict path of the attention module that owns that layer's KV cache.

    The attention module of a transformers decoder layer is the one whose class is an
    `...Attention` and that knows its `layer_idx` (with k_proj/v_proj, or a fused qkv_proj as in
    Phi3: how K/V are projected does not matter). Every layer 0..num_layers-1 must have one;
    UnsupportedModelError (naming `where`) otherwise.
    """
    found: dict[int, str] = {}
    for name, module in model.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and type(module).__name__.endswith("Attention"):
            found.setdefault(layer_idx, name)
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise UnsupportedModelError(
            f"{where}: no attention module (a ...Attention with a layer_idx) found for layer(s) {missing}",
            hint="kvcalib observes the K/V that transformers' attention modules write to their KV cache",
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
        decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                past_key_values=RecordingCache(decoder.config, observer))
    except StopForward:
        pass
    finally:
        observer.token_mask = None
