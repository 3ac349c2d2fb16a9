"""Observe the K and V each attention layer writes to its KV cache, by being that cache: every transformers
attention module calls its cache's `update(key, value, layer_idx)` with exactly what it stores (K after RoPE and
any k-norm, V as is, `[batch, kv_heads, seq, head_dim]`); a `RecordingCache` shows them to an observer (which may
return replacements: eval's FP8 cache) and hands them back, the model's own attention unchanged. Q never reaches the
cache: `observing_queries` wraps the function transformers' AttentionInterface returns, which also feeds hf.samples."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import DynamicCache

from kvcalib.core.errors import UnsupportedModelError
from kvcalib.hf.internals import attention_functions, cache_kwargs

__all__ = [
    "FanOutCache",
    "KVAbsmaxObserver",
    "QuantizingCache",
    "RecordingCache",
    "StopForward",
    "attention_modules",
    "observe_batch",
    "observing_queries",
]


class RecordingCache(DynamicCache):
    """A DynamicCache for one prefill whose `update` shows K/V to an observer and stores nothing."""

    def __init__(self, config: Any, observer: Any) -> None:
        super().__init__(config=config)
        self.observer = observer

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        replaced = self.observer.observe(layer_idx, key_states, value_states)
        return replaced if replaced is not None else (key_states, value_states)


class QuantizingCache(DynamicCache):
    """A real DynamicCache that stores what `quantizer.observe` makes of every K/V (None: an ordinary cache)."""

    def __init__(self, config: Any, quantizer: Any) -> None:
        super().__init__(config=config)
        self.quantizer = quantizer

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quantizer is not None:
            key_states, value_states = self.quantizer.observe(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class FanOutCache(DynamicCache):
    """An ordinary cache that also writes every K/V into `children` (e.g. a QuantizingCache per scale set)
    while attention reads the fresh K/V; empty `children` to stop."""

    def __init__(self, config: Any, children: list[DynamicCache]) -> None:
        super().__init__(config=config)
        self.children = children

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for child in self.children:
            child.update(key_states, value_states, layer_idx, *args, **kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class StopForward(Exception):
    """Raised after the last layer's K/V are recorded: nothing after it is needed."""


class KVAbsmaxObserver:
    """Running absmax of K, V (and Q with `queries`) per layer and head, padding masked out (`start_batch`)."""

    def __init__(self, num_layers: int, queries: bool = False, sampler: Any = None) -> None:
        self.num_layers = num_layers
        self.queries = (
            queries  # also observe Q (see observing_queries); the forward stops after the last Q
        )
        self.sampler = sampler  # a kvcalib.hf.samples.AttentionSampler: keeps the chosen sequences' attention calls
        self.k_heads: list[torch.Tensor | None] = [
            None
        ] * num_layers  # [kv_heads] float32 per layer
        self.v_heads: list[torch.Tensor | None] = [None] * num_layers
        self.q_heads: list[torch.Tensor | None] = [
            None
        ] * num_layers  # [attention heads] float32 per layer
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
                raise RuntimeError(
                    f"layer {layer_idx}: K/V/Q cover {(per_token.shape[0], per_token.shape[2])} "
                    f"tokens but the batch mask is {tuple(mask.shape)}"
                )
            per_token = per_token.masked_fill(~mask[:, None, :], 0.0)
        return per_token.amax(dim=(0, 2))

    @staticmethod
    def _merge(
        store: list[torch.Tensor | None], layer_idx: int, heads: torch.Tensor, what: str
    ) -> None:
        old = store[layer_idx]
        if old is not None and old.shape != heads.shape:
            raise UnsupportedModelError(
                f"layer {layer_idx}: {what} had {old.numel()} heads in one forward and "
                f"{heads.numel()} in another",
                hint="kvcalib needs a fixed head count per layer",
            )
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
        layer_idx = getattr(module, "layer_idx", None)
        self._check_layer(layer_idx)
        if (
            self.queries
        ):  # Q as the module hands it to its attention function: after RoPE (and q-norm)
            self._merge(self.q_heads, layer_idx, self._head_absmax(layer_idx, query), "Q")
            self.q_observed[layer_idx] += 1
        if self.sampler is not None:
            self.sampler.record(layer_idx, query, key, value, attention_mask, kwargs, module)
        if layer_idx == self.num_layers - 1:
            raise StopForward


@contextmanager
def observing_queries(observer: Any) -> Iterator[None]:
    """While inside, each attention module's call through transformers' AttentionInterface goes to
    `observer.observe_call` first, or to `observer.attend(function, module, ...)` where it has one (eval's FP8)."""
    interface = attention_functions()
    real = type(interface).get_interface

    def get_interface(attn_implementation: str, default: Any) -> Any:
        function = real(interface, attn_implementation, default)

        def observed(
            module: torch.nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            attend = getattr(
                observer, "attend", None
            )  # an observer that runs the attention itself (eval's FP8)
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
    """layer -> path of the `...Attention` module with that `layer_idx`; every layer must have one."""
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
def observe_batch(
    decoder: torch.nn.Module,
    observer: KVAbsmaxObserver,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> None:
    """Run one right-padded batch through the decoder stack (no LM head), recording K/V absmax."""
    observer.start_batch(input_ids, attention_mask)
    try:
        with observing_queries(observer) if observer.sees_attention_calls else nullcontext():
            decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=True,
                **cache_kwargs(decoder, RecordingCache(decoder.config, observer)),
            )
    except StopForward:
        pass
    finally:
        observer.end_batch()
