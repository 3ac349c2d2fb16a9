"""Run a model with its KV cache quantised to FP8 exactly as the target chip does it.

`KVQuantizer`, an attention hook (kvcalib.hf.attention), replaces each layer's K/V with `fp8.fake_quantize(x, s,
target)` before attention reads them (s: one per layer, or [1, H, 1, 1] per KV head). With `fp8_attention` it also
runs attention as FP8 attention does: Q quantised with its q_scale, the model's attention function on the FP8 Q, K,
V in float32 (probabilities unquantised: vLLM's compressed-tensors path has no prob_scale). `KVErrorMeter` rides
along the unquantised pass and measures each configuration's per-layer SQNR and saturation on the real K/V (and Q).

`FreshPrefill` runs the Neuron order in one forward: a row's prompt (its first ⌈n/2⌉ tokens) attends to fresh K/V,
each later query row to all K/V quantised, as a decode step reads the FP8 cache with its own K/V written first; each
position's K/V come from its own row's path, so this is prefill + token-by-token decode exactly (tests/evaluate): the
prompt's K/V as the plugin's prefill writes them, each decode step's as its decode kernel does (fp8.tkg_write).
With `chunk`, the prompt arrives in pieces of that many tokens (segmented prefill, a prefix-cache hit): each piece
attends to its own fresh K/V and reads the earlier pieces' from the FP8 cache as AWS's fused sliding-window prefill
kernel writes and reads them (fp8.swa_fused_cte; aws-neuron/nki-library at 092a49d, experimental/attention/
swa_fused_cte_torch.py): the chunked Neuron order.

With `mxfp8`, FreshPrefill runs Trainium 3's MXFP8 KV cache (kvcalib.core.mxfp8): the prompt on fresh K/V, each
decode step as AWS's attention_mxfp8_tkg reference computes it (experimental/attention_mxfp8/
attention_mxfp8_tkg_torch.py at 092a49d): Q * scaling through MXFP8 (8 heads x 4 elements a scale), scores
against the MXFP8 cache rounded to bf16, exp(scores - max) through MXFP8 again (8 heads x 4 tokens) before the V
product, the sum of the unquantised exps as the denominator, the step's own K/V fresh with the unquantised Q. No
per-tensor scale takes part.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvcalib.core import fp8, mxfp8
from kvcalib.core.choice import ScaleChoice
from kvcalib.core.errors import UnsupportedModelError
from kvcalib.hf.attention import check_layer
from kvcalib.hf.samples import AttentionSampler, attention_error

__all__ = [
    "FreshPrefill",
    "KVErrorMeter",
    "KVQuantizer",
    "KindQuantStats",
    "LayerQuantStats",
    "Scale",
    "decode_rows",
    "is_per_head",
]


@dataclass(frozen=True)
class KindQuantStats:
    """One layer's K, V or Q in LayerQuantStats: sqnr_db, clipped (fraction saturated at ±fp8_max); K and V: absmax
    (unquantised), clip_at (|x| that saturates; per head, the largest scale's)."""

    sqnr_db: float
    clipped: float
    absmax: float | None = None
    clip_at: float | None = None

    OMIT_NONE = True


@dataclass(frozen=True)
class LayerQuantStats:
    """One layer's quantisation error in eval's layers: layer, k, v, q (KindQuantStats; q with FP8 attention), in
    to_json() as k_sqnr_db, v_sqnr_db, k_clipped, v_clipped (fraction saturated at ±fp8_max), k_absmax, v_absmax
    (unquantised), k_clip_at, v_clip_at (|x| that saturates; per head, the largest scale's), q_sqnr_db, q_clipped;
    where measured: attention_error (||ΔO|| / ||O||), delta_nll_alone, kl_alone (nats with only this layer's K/V
    quantised, on eval's first layer_rows rows); chosen (from a kvcalib checkpoint's provenance: {"k": ..., "v": ...},
    each the scale objective's choice: its label))."""

    layer: int
    k: KindQuantStats
    v: KindQuantStats
    q: KindQuantStats | None = None
    attention_error: float | None = None
    delta_nll_alone: float | None = None
    kl_alone: float | None = None
    chosen: dict[str, ScaleChoice] | None = None

    OMIT_NONE = True
    JSON = {
        "k": None,
        "v": None,
        "q": None,
        "k_": "k",
        "v_": "v",
        "q_": "q",
    }  # flat: k_sqnr_db, ...


Scale = float | torch.Tensor  # one per layer, or [1, heads, 1, 1] per head


def is_per_head(*per_layer: list[Scale]) -> bool:
    return any(isinstance(s, torch.Tensor) for scales in per_layer for s in scales)


@dataclass(eq=False)
class KVQuantizer:
    """An attention hook: K/V as their FP8 round trip on the target; with `fp8_attention` Q too (module docstring)."""

    k_scales: list[Scale]
    v_scales: list[Scale]
    target: fp8.Target
    q_scales: list[Scale] | None = None
    fp8_attention: bool = False
    only: int | None = None  # this layer's K/V quantised only (eval's layers alone)

    @property
    def num_layers(self) -> int:
        return len(self.k_scales)

    @property
    def sees_attention_calls(self) -> bool:  # kvcalib.hf.attention.observing_attention
        return self.fp8_attention

    def _quantize(self, x: torch.Tensor, scale: Scale) -> torch.Tensor:
        if isinstance(scale, torch.Tensor):
            scale = scale.to(x.device)
        out = fp8.fake_quantize(x, scale, self.target)
        # FP8 attention: the FP8 values, exactly, in float32
        return out.float() if self.fp8_attention else out

    def observe(
        self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        i = check_layer(layer_idx, self.num_layers)
        if self.only in (None, i):
            return self._quantize(key, self.k_scales[i]), self._quantize(value, self.v_scales[i])
        return None

    def attend(
        self,
        function: Any,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        i = check_layer(getattr(module, "layer_idx", None), self.num_layers)
        q = self._quantize(query, self.q_scales[i])
        mask = (
            attention_mask.float()
            if attention_mask is not None and attention_mask.is_floating_point()
            else attention_mask
        )
        output, weights = function(module, q, key.float(), value.float(), mask, *args, **kwargs)
        return output.to(query.dtype), weights


def decode_rows(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the positions each right-padded row of n real tokens decodes in the Neuron order: from ⌈n/2⌉."""
    real = mask.bool()
    return real & (
        torch.arange(mask.shape[1], device=mask.device) >= (real.sum(1, keepdim=True) + 1) // 2
    )


class FreshPrefill:
    """An attention hook: `hook` (a KVQuantizer, whose `observe` returns quantised K/V or None) read by the
    decode rows (decode_rows(mask) of the batch's [B, S] mask) only; the others attend to the fresh K/V, or with
    `chunk` to their own piece's fresh K/V and the earlier pieces' from the cache (module docstring). The cache holds
    the prompt's K/V as the prefill wrote them (the plugin's write, or swa_fused_cte's with `chunk`) and each decode
    step's as the decode kernel writes them (fp8.tkg_write)."""

    sees_attention_calls = True  # `attend` takes every attention call (kvcalib.hf.attention)

    def __init__(
        self, hook: Any, mask: torch.Tensor, chunk: int | None = None, mxfp8: bool = False
    ) -> None:
        self.hook, self.decode, self.chunk, self.mxfp8 = hook, decode_rows(mask), chunk, mxfp8
        self.prompt_len = int((~self.decode & mask.bool()).sum(1).max())

    def observe(self, *args: Any) -> None:
        """The cache hands attention the fresh K/V; `attend` quantises them."""

    def attend(
        self,
        function: Any,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        fresh, weights = function(module, query, key, value, *args, **kwargs)
        if self.mxfp8:  # no per-tensor scale takes part
            if kwargs.get("s_aux") is not None or kwargs.get("softcap"):
                raise UnsupportedModelError(
                    f"{type(module).__name__} has attention sinks or soft-capping, which Trainium 3's MXFP8 decode "
                    "kernel (attention_mxfp8_tkg) does not compute",
                    hint="evaluate this model with --order neuron",
                )
            scaling = kwargs.get("scaling") or module.scaling
            read = mxfp8_decode_attention(query, key, value, args[0], scaling)  # args[0]: the mask
            return torch.where(self.decode[:, :, None, None], read.to(fresh.dtype), fresh), weights
        layer = getattr(module, "layer_idx", None)
        cache = self.hook.observe(layer, key, value)  # as the prefill writes it
        if cache is None:
            return fresh, weights
        position = torch.arange(key.shape[2], device=key.device)
        if self.chunk:  # the pieces' kernel writes the prompt's K/V
            i, prompt = check_layer(layer, self.hook.num_layers), position < self.prompt_len
            cache = tuple(
                torch.where(
                    prompt[:, None], fp8.swa_fused_cte_round_trip(x, s[i], self.hook.target), c
                )
                for x, s, c in zip((key, value), (self.hook.k_scales, self.hook.v_scales), cache)
            )
        if self.hook.target != (decode := fp8.tkg_write(self.hook.target)):
            written = replace(self.hook, target=decode).observe(layer, key, value)
            steps = self.decode[:, None, : key.shape[2], None]
            cache = tuple(torch.where(steps, w, c) for w, c in zip(written, cache))
        attend = (
            functools.partial(self.hook.attend, function) if self.hook.fp8_attention else function
        )
        read = attend(module, query, *cache, *args, **kwargs)[0]  # [B, S, heads, head_dim]
        out = torch.where(self.decode[:, :, None, None], read.to(fresh.dtype), fresh)
        for start in range(self.chunk or self.prompt_len, self.prompt_len, self.chunk or 1):
            prior = (position < start)[None, None, :, None]  # the earlier pieces, from the cache
            k, v = (torch.where(prior, c, x) for c, x in zip(cache, (key, value)))
            piece = function(module, query, k, v, *args, **kwargs)[0]
            rows = ~self.decode & (position[: self.decode.shape[1]] >= start)
            out = torch.where(rows[:, :, None, None], piece.to(fresh.dtype), out)
        return out, weights


def mxfp8_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Each query row as one decode step of attention_mxfp8_tkg: keys before it from the MXFP8 cache (K grouped
    along head_dim, V along tokens), its own key fresh with the unquantised Q. query [B, H, S, D], key/value
    [B, Hkv, T, D] (T >= S, the last S keys the queries' own), mask the model's ([B or 1, 1, S, T], bool or additive;
    None: causal); returns [B, S, H, D] float32."""
    b, heads, s, d = query.shape
    kv_heads, t = key.shape[1], key.shape[2]
    group = heads // kv_heads
    q = (query.float() * scaling).reshape(b, kv_heads, group, s, d)
    # the reference's groups: 8 query heads (of one KV head; zero-padded to 8) x 4 elements
    q_rt = mxfp8.round_trip(q, {2: 8, 4: 4})
    k_mx = mxfp8.round_trip(key, {3: mxfp8.GROUP})
    v_mx = mxfp8.round_trip(value, {2: mxfp8.GROUP})  # 32 tokens from position 0 (a block holds 4)
    own = torch.arange(s, device=query.device) + (t - s)  # each query's own key
    position = torch.arange(t, device=query.device)
    prior = position[None, :] < own[:, None]  # [S, T]: the keys before each query's own
    if mask is not None:
        prior = (
            prior & (mask[..., :t] if mask.dtype == torch.bool else mask[..., :t] == 0)[:, :, None]
        )
    scores = torch.einsum("bkgsd,bktd->bkgst", q_rt, k_mx).masked_fill(~prior, -65504.0)
    scores = scores.to(torch.bfloat16).float()
    own_k, own_v = key.float()[:, :, own], value.float()[:, :, own]  # [B, Hkv, S, D]
    own_score = torch.einsum("bkgsd,bksd->bkgs", q, own_k)
    out = torch.zeros(b, kv_heads, group, s, d, device=query.device)
    total = torch.zeros(b, kv_heads, group, s, device=query.device)
    running = torch.full_like(total, -1e38)
    for start in range(0, t, 2048):  # the kernel's chunks, each an online-softmax step
        chunk = scores[..., start : start + 2048]
        top = torch.maximum(running, chunk.amax(-1))
        correction = torch.exp(running - top)
        e = torch.exp(chunk - top[..., None])
        total = total * correction + e.sum(-1)
        out = out * correction[..., None] + torch.einsum(
            "bkgst,bktd->bkgsd", mxfp8.round_trip(e, {2: 8, 4: 4}), v_mx[:, :, start : start + 2048]
        )
        running = top
    top = torch.maximum(running, own_score)
    correction, e_own = torch.exp(running - top), torch.exp(own_score - top)
    out = out * correction[..., None] + e_own[..., None] * own_v[:, :, None]
    total = total * correction + e_own
    out = out / total[..., None]
    return out.reshape(b, heads, s, d).transpose(1, 2).to(torch.bfloat16).float()


class KVErrorMeter:
    """On the unquantised pass, per layer and configuration: SQNR and the fraction of elements that saturate, over
    real tokens only (`token_mask`, [B, S] bool, set per batch); each layer's figure is its own quantiser's."""

    def __init__(
        self,
        configs: dict[str, KVQuantizer],
        device: torch.device,
        sampler: AttentionSampler | None = None,
    ) -> None:
        self.configs = configs
        self.num_layers = next(iter(configs.values())).num_layers
        self.token_mask = None
        self.fp8_attention = any(q.fp8_attention for q in configs.values())
        self.sampler = (
            sampler  # attention samples: each configuration's attention-output error per layer
        )
        self.sees_attention_calls = self.fp8_attention or sampler is not None
        # [config, layer, kind(k/v/q), (signal, noise, clipped, count)] float64 sums; absmax [layer, kind]
        self._sums = torch.zeros(
            len(configs), self.num_layers, 3, 4, dtype=torch.float64, device=device
        )
        self._absmax = torch.zeros(self.num_layers, 3, dtype=torch.float64, device=device)

    def observe(self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        i = check_layer(layer_idx, self.num_layers)
        self._measure(i, 0, key)
        self._measure(i, 1, value)

    def observe_call(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> None:
        """One unquantised attention call: Q's error under FP8 attention, and the attention samples."""
        i = check_layer(getattr(module, "layer_idx", None), self.num_layers)
        if self.fp8_attention:
            self._measure(i, 2, query)
        if self.sampler is not None:
            self.sampler.record(i, query, key, value, attention_mask, kwargs, module)

    def _measure(self, layer: int, kind: int, x: torch.Tensor) -> None:
        """Sums for `x`, K/V/Q (`kind` 0/1/2) of `layer`, under each configuration that has its scales (Q: the FP8
        attention runs only)."""
        xf = x.float().transpose(1, 2)  # [B, S, H, D]
        if self.token_mask is not None:
            xf = xf[self.token_mask]  # [real tokens, H, D]
        if xf.numel() == 0:
            return
        self._absmax[layer, kind] = torch.maximum(
            self._absmax[layer, kind], xf.abs().max().double()
        )
        signal = xf.double().pow(2).sum()
        for c, q in enumerate(self.configs.values()):
            if not (scales := (q.k_scales, q.v_scales, q.q_scales)[kind]):
                continue
            scale, target = scales[layer], q.target
            if isinstance(scale, torch.Tensor):  # [1, H, 1, 1] -> [1, H, 1] for [..., H, D]
                scale = scale.reshape(1, -1, 1).to(xf.device)
            noise = (fp8.fake_quantize(xf, scale, target) - xf).double().pow(2).sum()
            clipped = (fp8.to_fp8_domain(xf, scale, target).abs() > target.fp8_max).sum()
            self._sums[c, layer, kind] += torch.stack(
                [signal, noise, clipped.double(), signal.new_tensor(xf.numel())]
            )

    def layer_stats(
        self, name: str, alone: list[tuple[float, float]] | None = None
    ) -> list[LayerQuantStats]:
        """Per layer, configuration `name`'s figures; `alone`: each layer's (ΔNLL, KL) quantised alone, if measured."""
        quantizer, sums = self.configs[name], self._sums[list(self.configs).index(name)].cpu()
        absmax = self._absmax.cpu()
        stats = []
        for i in range(self.num_layers):
            k, v, q = (
                KindQuantStats(fp8.sqnr_db(signal, noise), clipped / max(count, 1.0), *extra)
                for (signal, noise, clipped, count), extra in zip(
                    sums[i].tolist(),
                    [
                        *(
                            (absmax[i, j].item(), _clip_at(scales[i], quantizer.target))
                            for j, scales in enumerate((quantizer.k_scales, quantizer.v_scales))
                        ),
                        (),  # Q: no absmax, no clip level
                    ],
                    strict=True,
                )
            )
            stats.append(
                LayerQuantStats(
                    i,
                    k,
                    v,
                    q if quantizer.fp8_attention else None,
                    self.sampler
                    and attention_error(
                        self.sampler.samples[i],
                        quantizer.k_scales[i],
                        quantizer.v_scales[i],
                        quantizer.target,
                    ),
                    *(alone[i] if alone else (None, None)),
                )
            )
        return stats


def _clip_at(scale: Scale, target: fp8.Target) -> float:
    """|x| above which a value saturates with `scale` (its largest head's) on `target`."""
    largest = float(scale.max()) if isinstance(scale, torch.Tensor) else scale
    return float(fp8.from_fp8_domain(torch.tensor(target.fp8_max), largest, target))
