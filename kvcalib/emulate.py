"""Run a model with its KV cache quantised to FP8 exactly as the target chip does it.

`KVQuantizer` plugs into the same attention hook as calibration (kvcalib.observe): every
layer's K and V, as written to the cache, are replaced by `fp8.fake_quantize(x, s, target)`
before attention reads them, and per-layer statistics (SQNR, saturated fraction) are kept
over real tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import fp8


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
    """Per-layer scales + target -> quantised K/V, with running error statistics."""

    def __init__(self, k_scales: list[float], v_scales: list[float], target: fp8.Target,
                 device: torch.device | str = "cpu") -> None:
        if len(k_scales) != len(v_scales):
            raise ValueError("k_scales and v_scales differ in length")
        self.num_layers = len(k_scales)
        self.k_scales = k_scales
        self.v_scales = v_scales
        self.target = target
        self.token_mask: torch.Tensor | None = None  # [B, S] bool, set per batch
        # per layer: signal power, noise power, clipped count, element count (sums), absmax
        self._k = torch.zeros(self.num_layers, 5, dtype=torch.float64, device=device)
        self._v = torch.zeros(self.num_layers, 5, dtype=torch.float64, device=device)

    def observe(self, layer_idx: Any, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise RuntimeError(f"attention layer {layer_idx!r} has no scale ({self.num_layers} layers)")
        k_hat = self._quantize(self._k[layer_idx], key, self.k_scales[layer_idx])
        v_hat = self._quantize(self._v[layer_idx], value, self.v_scales[layer_idx])
        return k_hat, v_hat

    def _quantize(self, acc: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
        # x: [B, H_kv, S, D]
        x_hat = fp8.fake_quantize(x, scale, self.target)
        xf = x.float()
        if self.token_mask is not None:
            real = self.token_mask[:, None, :, None].expand_as(xf)
        else:
            real = torch.ones_like(xf, dtype=torch.bool)
        err = (x_hat.float() - xf)[real]
        xr = xf[real]
        scaled = fp8.to_fp8_domain(xr, scale, self.target)
        acc[:4] += torch.stack([
            xr.double().pow(2).sum(), err.double().pow(2).sum(),
            (scaled.abs() > self.target.fp8_max).sum().double(),
            torch.tensor(float(xr.numel()), dtype=torch.float64, device=xr.device),
        ])
        if xr.numel():
            acc[4] = torch.maximum(acc[4], xr.abs().max().double())
        return x_hat

    def clip_threshold(self, scale: float) -> float:
        """|x| above which a value saturates with scale `scale` on this target."""
        one = fp8.from_fp8_domain(torch.tensor(self.target.fp8_max), scale, self.target)
        return float(one)

    def layer_stats(self) -> list[LayerQuantStats]:
        k, v = self._k.cpu(), self._v.cpu()
        out = []
        for i in range(self.num_layers):
            out.append(LayerQuantStats(
                layer=i,
                k_sqnr_db=fp8.sqnr_db(k[i, 0].item(), k[i, 1].item()),
                v_sqnr_db=fp8.sqnr_db(v[i, 0].item(), v[i, 1].item()),
                k_clipped=k[i, 2].item() / max(k[i, 3].item(), 1.0),
                v_clipped=v[i, 2].item() / max(v[i, 3].item(), 1.0),
                k_absmax=k[i, 4].item(), v_absmax=v[i, 4].item(),
                k_clip_at=self.clip_threshold(self.k_scales[i]), v_clip_at=self.clip_threshold(self.v_scales[i]),
            ))
        return out
