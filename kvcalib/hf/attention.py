"""Observe the K and V each attention layer writes to its KV cache, by being that cache: every transformers
attention module calls its cache's `update(key, value, layer_idx)` with exactly what it stores (K after RoPE and
any k-norm, V as is, `[batch, kv_heads, seq, head_dim]`); an `ObservedCache` shows them to an observer (which may
return replacements: eval's FP8 cache). Q never reaches the cache: `observing_attention` switches the model to an
attention function registered with transformers' AttentionInterface that shows each call to the observer (Q, and
hf.samples) and runs the model's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache

from kvcalib.core.errors import UnsupportedModelError
from kvcalib.hf import internals

__all__ = [
    "KVAbsmaxObserver",
    "ObservedCache",
    "StopForward",
    "attention_modules",
    "check_layer",
    "fan_out",
    "observed_forward",
    "observing_attention",
]


class ObservedCache(DynamicCache):
    """A DynamicCache whose `update` first hands each layer's fresh K/V to `observe(layer_idx, key, value)`: an
    observer's record, eval's FP8 round trip (it returns the K/V to use instead), another cache's write (the needle
    probe's fan-out); with `store` False it keeps nothing (one prefill) and returns them."""

    def __init__(
        self, config: Any, observe: Callable[..., Any] | None = None, store: bool = True
    ) -> None:
        super().__init__(config=config)
        self.observe, self.store = observe, store

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        replaced = self.observe and self.observe(layer_idx, key_states, value_states)
        if replaced is not None:
            key_states, value_states = replaced
        if not self.store:
            return key_states, value_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def fan_out(caches: list[DynamicCache]) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    """An ObservedCache's `observe` that writes every fresh K/V into each of `caches` as well (the needle probe's
    prefill: attention reads the fresh K/V, each scale set's cache stores its own)."""

    def write(layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        for cache in caches:
            cache.update(key, value, layer_idx)

    return write


class StopForward(Exception):
    """The one way kvcalib ends a forward early, raised by an observer or hook once nothing after is needed (after
    the last layer's K/V or attention call; at the decoder layer whose inputs are wanted, carrying them)."""


def check_layer(layer_idx: Any, num_layers: int) -> int:
    """`layer_idx` as an attention module reported it, checked to be one of the model's `num_layers`."""
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < num_layers:
        raise UnsupportedModelError(
            f"an attention layer reported layer_idx {layer_idx!r}, outside the model's {num_layers} layers",
            hint="kvcalib needs attention modules numbered 0..num_hidden_layers-1 (transformers' layer_idx)",
        )
    return layer_idx


class KVAbsmaxObserver:
    """Running absmax of K, V (and Q with `queries`) per layer and head, padding masked out (`batch`)."""

    def __init__(self, num_layers: int, queries: bool = False, sampler: Any = None) -> None:
        self.num_layers = num_layers
        self.queries = queries  # also Q: the forward then stops after the last attention call
        # a kvcalib.hf.samples.AttentionSampler: keeps the chosen sequences' attention calls
        self.sampler = sampler
        # the attention calls are needed (Q, or the objective's samples): observing_attention
        self.sees_attention_calls = queries or sampler is not None
        # per layer: [kv_heads] float32 (K, V), [attention heads] (Q)
        self.k_heads, self.v_heads, self.q_heads = ([None] * num_layers for _ in "kvq")
        # forward calls that reached each layer (K/V, Q)
        self.observed, self.q_observed = [0] * num_layers, [0] * num_layers
        self.token_mask = None

    def _merge(
        self, store: list[torch.Tensor | None], layer_idx: int, states: torch.Tensor
    ) -> None:
        """[B, H, S, D] -> absmax per head [H] over the real tokens (NaN/inf propagate on purpose), into `store`."""
        per_token = states.detach().abs().amax(dim=3).float()  # [B, H, S]
        if self.token_mask is not None:
            per_token = per_token.masked_fill(~self.token_mask[:, None, :], 0.0)
        heads, old = per_token.amax(dim=(0, 2)), store[layer_idx]
        store[layer_idx] = heads if old is None else torch.maximum(old, heads)

    def observe(self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        check_layer(layer_idx, self.num_layers)
        self._merge(self.k_heads, layer_idx, key)
        self._merge(self.v_heads, layer_idx, value)
        self.observed[layer_idx] += 1
        if layer_idx == self.num_layers - 1 and not self.sees_attention_calls:
            raise StopForward

    @contextmanager
    def batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Iterator[None]:
        """Around each forward: which tokens are real (padding never counts), which rows are sampled; the StopForward
        that ends the forward ends here."""
        self.token_mask = attention_mask.bool()
        if self.sampler is not None:
            self.sampler.start_batch(input_ids, attention_mask)
        try:
            yield
        except StopForward:
            pass
        finally:
            self.token_mask = None
            if self.sampler is not None:
                self.sampler.end_batch()

    def observe_call(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> None:
        """One attention call as the module makes it: Q's absmax, the objective's sample; stops after the last."""
        layer_idx = check_layer(getattr(module, "layer_idx", None), self.num_layers)
        # Q as the module hands it to its attention function: after RoPE (and q-norm)
        if self.queries:
            self._merge(self.q_heads, layer_idx, query)
            self.q_observed[layer_idx] += 1
        if self.sampler is not None:
            self.sampler.record(layer_idx, query, key, value, attention_mask, kwargs, module)
        if layer_idx == self.num_layers - 1:
            raise StopForward


# transformers' attention functions for a model switched to kvcalib's: (observer, the model's own implementation)
_OBSERVING = ContextVar("kvcalib_observing")


def _observed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    observer, real = _OBSERVING.get()
    # the model's own function: the registered one (sdpa), or its modeling file's eager
    function = AttentionInterface().get(real) or internals.eager_attention(type(module))
    # an observer that runs the attention itself (eval's FP8)
    attend = getattr(observer, "attend", None)
    if attend is not None:
        return attend(function, module, query, key, value, attention_mask, *args, **kwargs)
    observer.observe_call(module, query, key, value, attention_mask, kwargs)
    return function(module, query, key, value, attention_mask, *args, **kwargs)


@contextmanager
def observing_attention(model: Any, observer: Any) -> Iterator[None]:
    """While inside, where `observer.sees_attention_calls`, each attention call of `model` goes to
    `observer.observe_call` and then the model's own attention (eager or sdpa, as it was loaded), or to
    `observer.attend(function, module, ...)` where it has one: `model` switched (its `attn_implementation`) to a
    function registered with transformers' AttentionInterface, and back after."""
    if not getattr(observer, "sees_attention_calls", False):
        yield
        return
    real = model.config._attn_implementation
    name = f"kvcalib_{real}"
    AttentionInterface.register(name, _observed_attention)
    masks = AttentionMaskInterface()
    if real in masks:  # the masks the model's own implementation takes
        AttentionMaskInterface.register(name, masks[real])
    token = _OBSERVING.set((observer, real))
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface, "
                "where kvcalib observes Q and the attention calls",
                hint="calibrate without --attention-scales (and eval without FP8 attention or attention error)",
            )
        yield
    finally:
        try:
            model.set_attn_implementation(real)
        finally:
            _OBSERVING.reset(token)


def attention_modules(model: torch.nn.Module, num_layers: int, where: object) -> dict[int, str]:
    """layer -> path of the `...Attention` module with that `layer_idx`; every layer must have one."""
    found = {}
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


def observed_forward(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, observe: Any, **kwargs: Any
) -> Any:
    """`model` on one right-padded batch, its cache showing each layer's fresh K/V to `observe` and keeping none."""
    cache = ObservedCache(model.config, observe, store=False)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=True,
        **internals.cache_kwargs(model, cache),
        **kwargs,
    )
