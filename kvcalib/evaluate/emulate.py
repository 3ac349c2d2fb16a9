"""Run a model with its KV cache quantised to FP8 exactly as the target chip does it.

`KVQuantizer` plugs into the same attention hook as calibration (kvcalib.observe): every
layer's K and V, as written to the cache, are replaced by `fp8.fake_quantize(x, s, target)`
before attention reads them. `KVErrorMeter` rides along the unquantised pass and measures,
per layer, what each configuration's quantiser does to the real K/V (SQNR, saturation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcalib.core import fp8

__all__ = ["KVErrorMeter", "KVQuantizer", "LayerQuantStats"]


@dataclass(frozen=True)
class LayerQuantStats:
    layer: int
    k_sqnr_db: float
    v_sqnr_db: float
    k_clipped: float  # fraction of K elements that saturated at ±fp8_max
    v_clipped: float
    k_absmax: float  # of the unquantised K on the evaluation tokens
    v_absmax: float
    k_clip_at: float  # |K| above this saturates with this layer's scale
    v_clip_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "k_sqnr_db": self.k_sqnr_db, "v_sqnr_db": self.v_sqnr_db,
                "k_clipped": self.k_clipped, "v_clipped": self.v_clipped,
                "k_absmax": self.k_absmax, "v_absmax": self.v_absmax,
                "k_clip_at": self.k_clip_at, "v_clip_at": self.v_clip_at}


class KVQuantizer:
    """Replaces every layer's K/V with their FP8 round trip on the target (an attention hook)."""

    def __init__(self, k_scales: list[float], v_scales: list[float], target: fp8.Target) -> None:
        if len(k_scales) != len(v_scales):
            raise ValueError("k_scales and v_scales differ in length")
        self.num_layers = len(k_scales)
        self.k_scales = k_scales
        self.v_scales = v_scales
        self.target = target

    def _check(self, layer_idx: Any) -> int:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise RuntimeError(f"attention layer {layer_idx!r} has no scale ({self.num_layers} layers)")
        return layer_idx

    def observe(self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._check(layer_idx)
        return (fp8.fake_quantize(key, self.k_scales[i], self.target),
                fp8.fake_quantize(value, self.v_scales[i], self.target))


class KVErrorMeter:
    """On the unquantised pass: what each configuration's quantiser would do to the model's real K/V.

    Per layer and configuration: SQNR and the fraction of elements that saturate, over real
    tokens only (`token_mask`, [B, S] bool, set per batch). Measured on the unquantised K/V so
    that each layer's figure is its own quantiser's, not error carried in from earlier layers.
    """

    def __init__(self, configs: dict[str, KVQuantizer], device: torch.device | str = "cpu") -> None:
        self.configs = configs
        self.num_layers = next(iter(configs.values())).num_layers
        self.token_mask: torch.Tensor | None = None
        # [config, layer, kind(k/v), (signal, noise, clipped, count)] float64 sums; absmax [layer, kind]
        self._sums = torch.zeros(len(configs), self.num_layers, 2, 4, dtype=torch.float64, device=device)
        self._absmax = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=device)

    def observe(self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise RuntimeError(f"attention layer {layer_idx!r} is outside the model's {self.num_layers} layers")
        for kind, x in enumerate((key, value)):  # x: [B, H_kv, S, D]
            xf = x.float()
            if self.token_mask is not None:
                xf = xf.transpose(1, 2)[self.token_mask]  # [real tokens, H_kv, D]
            if xf.numel() == 0:
                continue
            self._absmax[layer_idx, kind] = torch.maximum(self._absmax[layer_idx, kind], xf.abs().max().double())
            signal = xf.double().pow(2).sum()
            for c, quantizer in enumerate(self.configs.values()):
                scale = (quantizer.k_scales, quantizer.v_scales)[kind][layer_idx]
                noise = (fp8.fake_quantize(xf, scale, quantizer.target) - xf).double().pow(2).sum()
                clipped = (fp8.to_fp8_domain(xf, scale, quantizer.target).abs() > quantizer.target.fp8_max).sum()
                self._sums[c, layer_idx, kind] += torch.stack(
                    [signal, noise, clipped.double(), torch.tensor(float(xf.numel()), dtype=torch.float64, device=xf.device)]
                )

    def layer_stats(self, name: str) -> list[LayerQuantStats]:
        c = list(self.configs).index(name)
        quantizer = self.configs[name]
        sums, absmax = self._sums[c].cpu(), self._absmax.cpu()
        stats = []
        for i in range(self.num_layers):
            (ks, kn, kc, kcount), (vs, vn, vc, vcount) = sums[i].tolist()
            stats.append(LayerQuantStats(
                layer=i, k_sqnr_db=fp8.sqnr_db(ks, kn), v_sqnr_db=fp8.sqnr_db(vs, vn),
                k_clipped=kc / max(kcount, 1.0), v_clipped=vc / max(vcount, 1.0),
                k_absmax=absmax[i, 0].item(), v_absmax=absmax[i, 1].item(),
                k_clip_at=_clip_threshold(quantizer.k_scales[i], quantizer.target),
                v_clip_at=_clip_threshold(quantizer.v_scales[i], quantizer.target),
            ))
        return stats


def _clip_threshold(scale: float, target: fp8.Target) -> float:
    """|x| above which a value saturates with `scale` on `target`."""
    return float(fp8.from_fp8_domain(torch.tensor(target.fp8_max), scale, target))
