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
cache object made for each forward.

Q (for FP8 attention's q_scale) never reaches the cache: `observing_queries` shows it, as the
attention module hands it to its attention function (after RoPE and q-norm), by wrapping the
function transformers' AttentionInterface returns, for the duration of one forward only. The
same wrapper hands the scale objective its samples of whole attention calls (kvcalib.hf.samples).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import DynamicCache

from kvcalib.core.errors import UnsupportedModelError

__all__ = ["FanOutCache", "KVAbsmaxObserver", "QuantizingCache", "RecordingCache", "StopForward", "attention_modules",
           "observe_batch", "observing_queries"]


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


class QuantizingCache(DynamicCache):
    """A real DynamicCache (prefill and decoding) that stores what `quantizer.observe` makes of every K/V written:
    attention reads the FP8 values, as from a chip's FP8 KV cache. `quantizer` None: an ordinary cache."""

    def __init__(self, config: Any, quantizer: Any) -> None:
        super().__init__(config=config)
        self.quantizer = quantizer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quantizer is not None:
            key_states, value_states = self.quantizer.observe(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class FanOutCache(DynamicCache):
    """An ordinary cache whose `update` also writes every K/V into `children` (e.g. one QuantizingCache per scale
    set) while attention reads the fresh K/V: one prefill fills them all, as a chip that attends to the K/V it
    has just computed and writes them to its FP8 cache. Empty `children` to stop writing them."""

    def __init__(self, config: Any, children: list[DynamicCache]) -> None:
        super().__init__(config=config)
        self.children = children

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for child in self.children:
            child.update(key_states, value_states, layer_idx, *args, **kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class StopForward(Exception):
    """Raised after the last layer's K/V are recorded: nothing after it is needed."""


class KVAbsmaxObserver:
    """Running absmax of K and V per decoder layer and per KV head (and of Q per query head, when
    `queries` is set), kept on the device the K/V are on.

    Per-tensor absmax is the max over a layer's heads: max is exact, so per-head and per-tensor
    scales come from one observation. `token_mask` ([batch, seq] bool, True for real tokens) must
    be set before each forward so that padding positions never reach the statistics.
    """

    def __init__(self, num_layers: int, queries: bool = False, sampler: Any = None) -> None:
        self.num_layers = num_layers
        self.queries = queries  # also observe Q (see observing_queries); the forward stops after the last Q
        self.sampler = sampler  # a kvcalib.hf.samples.AttentionSampler: keeps the chosen sequences' attention calls
        self.k_heads: list[torch.Tensor | None] = [None] * num_layers  # [kv_heads] float32 per layer
        self.v_heads: list[torch.Tensor | None] = [None] * num_layers
        self.q_heads: list[torch.Tensor | None] = [None] * num_layers  # [attention heads] float32 per layer
        self.observed = [0] * num_layers  # forward calls that reached each layer
        self.q_observed = [0] * num_layers
        self.token_mask: torch.Tensor | None = None

    def _check_layer(self, layer_idx: Any) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise UnsupportedModelError(
                f"an attention layer reported layer_idx {layer_idx!r}, outside the model's {self.num_layers} layers",
                hint="kvcalib needs attention modules numbered 0..num_hidden_layers-1 (transformers' layer_idx)",
            )

    def _head_absmax(self, layer_idx: int, states: torch.Tensor) -> torch.Tensor:
        """[B, H, S, D] -> absmax per head [H] over the real tokens (NaN/inf propagate on purpose)."""
        per_token = states.detach().abs().amax(dim=3).float()  # [B, H, S]
        mask = self.token_mask
        if mask is not None:
            if mask.shape != (per_token.shape[0], per_token.shape[2]):
                raise RuntimeError(f"layer {layer_idx}: K/V/Q cover {(per_token.shape[0], per_token.shape[2])} "
                                   f"tokens but the batch mask is {tuple(mask.shape)}")
            per_token = per_token.masked_fill(~mask[:, None, :], 0.0)
        return per_token.amax(dim=(0, 2))

    @staticmethod
    def _merge(store: list[torch.Tensor | None], layer_idx: int, heads: torch.Tensor, what: str) -> None:
        old = store[layer_idx]
        if old is not None and old.shape != heads.shape:
            raise UnsupportedModelError(f"layer {layer_idx}: {what} had {old.numel()} heads in one forward and "
                                        f"{heads.numel()} in another",
                                        hint="kvcalib needs a fixed head count per layer")
        store[layer_idx] = heads if old is None else torch.maximum(old, heads)

    def observe(self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        self._check_layer(layer_idx)
        self._merge(self.k_heads, layer_idx, self._head_absmax(layer_idx, key), "K")
        self._merge(self.v_heads, layer_idx, self._head_absmax(layer_idx, value), "V")
        self.observed[layer_idx] += 1
        if layer_idx == self.num_layers - 1 and not self.sees_attention_calls:
            raise StopForward

    @property
    def sees_attention_calls(self) -> bool:
        """Whether the attention function's calls are needed (Q, or the objective's samples): observing_queries."""
        return self.queries or self.sampler is not None

    def start_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Before each forward: which tokens are real (padding never counts), which rows are sampled."""
        self.token_mask = attention_mask.bool()
        if self.sampler is not None:
            self.sampler.start_batch(input_ids, attention_mask)

    def end_batch(self) -> None:
        self.token_mask = None
        if self.sampler is not None:
            self.sampler.end_batch()

    def observe_query(self, layer_idx: Any, query: torch.Tensor) -> None:
        """Q as the attention module hands it to its attention function: after RoPE (and q-norm)."""
        self._check_layer(layer_idx)
        self._merge(self.q_heads, layer_idx, self._head_absmax(layer_idx, query), "Q")
        self.q_observed[layer_idx] += 1

    def observe_call(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """One attention call as the module makes it: Q's absmax, the objective's sample; stops after the last."""
        layer_idx = getattr(module, "layer_idx", None)
        self._check_layer(layer_idx)
        if self.queries:
            self.observe_query(layer_idx, query)
        if self.sampler is not None:
            self.sampler.record(layer_idx, query, key, value, attention_mask, kwargs, module)
        if layer_idx == self.num_layers - 1:
            raise StopForward


@contextmanager
def observing_queries(observer: Any) -> Iterator[None]:
    """While inside, every attention module that looks up its attention function in transformers'
    AttentionInterface (every family kvcalib serves does) shows its call to `observer.observe_call`
    before the function runs, unchanged: the module, its arguments and the function are the model's own.
    An observer with an `attend(function, module, query, key, value, ...)` method runs the call itself
    (kvcalib.evaluate's FP8 attention: Q quantised, the matmuls in float32).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    interface = ALL_ATTENTION_FUNCTIONS
    real = type(interface).get_interface

    def get_interface(attn_implementation: str, default: Any) -> Any:
        function = real(interface, attn_implementation, default)

        def observed(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
            attend = getattr(observer, "attend", None)  # an observer that runs the attention itself (eval's FP8)
            if attend is not None:
                return attend(function, module, query, key, value, attention_mask, *args, **kwargs)
            observer.observe_call(module, query, key, value, attention_mask, kwargs)
            return function(module, query, key, value, attention_mask, *args, **kwargs)

        return observed

    interface.get_interface = get_interface  # an instance attribute shadows the class's method
    try:
        yield
    finally:
        vars(interface).pop("get_interface", None)


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
    observer.start_batch(input_ids, attention_mask)
    try:
        with observing_queries(observer) if observer.sees_attention_calls else nullcontext():
            decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                    past_key_values=RecordingCache(decoder.config, observer))
    except StopForward:
        pass
    finally:
        observer.end_batch()
