"""Observation -> scales (per tensor or KV head; K/V, optionally Q) and the tensors written: `[1]` per tensor,
`[heads, 1, 1]` per head, as compressed-tensors' initialize_qparams makes and vLLM's compressed-tensors loader reads."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvcalib.calibration.engine import Observation
from kvcalib.calibration.objective import Scored
from kvcalib.calibration.options import KindScales, LayerScales
from kvcalib.core import fp8
from kvcalib.core.errors import CalibrationError
from kvcalib.core.schema import scale_key

__all__ = ["layer_scales", "scale_tensors"]


def _unobserved(counts: tuple[int, ...], model_dir: Path, what: str) -> None:
    missing = [i for i, n in enumerate(counts) if n == 0]
    if missing:
        raise CalibrationError(
            f"{model_dir}: decoder layer(s) {missing} {what} never observed during calibration",
            hint="the model's attention does not go through transformers' attention interface for these layers",
        )


def layer_scales(
    observation: Observation,
    target: fp8.Target,
    model_dir: Path,
    per_head: bool,
    queries: bool,
    choices: list[tuple[Scored, Scored]] | None,
    headroom: float,
) -> tuple[list[LayerScales], list[str]]:
    """Per-layer scales: absmax / fp8_max, or for K/V the objective's `choices`; per head each head's, per tensor one
    ([1]), their max. A K/V scale that keeps the absmax (per tensor: the tensor's) is raised to cover headroom x it; a
    clip stays a clip (a wider FP8 scale keeps the relative precision of normal values; only the smallest become
    subnormal)."""
    _unobserved(observation.observed, model_dir, "were")
    kinds = {"k": observation.k_heads, "v": observation.v_heads}
    if queries:
        _unobserved(observation.q_observed, model_dir, "had their Q")
        kinds["q"] = observation.q_heads
    warnings: list[str] = []
    layers = []
    for i in range(len(observation.observed)):
        picks = dict(zip("kv", choices[i])) if choices is not None else {}
        records = {}
        for kind, per_layer in kinds.items():
            heads, pick, room = (
                per_layer[i].float(),
                picks.get(kind),
                headroom if kind != "q" else 1.0,
            )
            absmax = float(heads.max())  # NaN and inf propagate through max
            if not math.isfinite(absmax):
                raise CalibrationError(
                    f"layer {i}: {kind.upper()} absmax is {absmax} (overflow in the calibration dtype)",
                    hint="calibrate with --dtype bfloat16 or --dtype float32",
                )
            if absmax == 0.0:
                warnings.append(
                    f"layer {i}: {kind.upper()} was exactly zero on every token; its scale is floored at "
                    f"{fp8.SCALE_FLOOR}"
                )
            scales, chosen = fp8.scale_from_absmax(heads, target), None
            if pick is not None:
                index = pick.index * heads.numel() if len(pick.index) == 1 else pick.index
                index = (list(index), list(range(heads.numel())))
                scales = pick.candidates.scales[index]
                chosen = float(pick.candidates.ranges[index][int(scales.argmax())])
            kept = heads if per_head else heads.max().reshape(1)
            scales = scales if per_head else scales.max().reshape(1)
            if room != 1.0:
                keeps = scales >= fp8.scale_from_absmax(kept, target)
                wider = torch.maximum(scales, fp8.scale_from_absmax(kept * room, target))
                scales = torch.where(keeps, wider, scales)
                chosen = float(scales.max()) * target.fp8_max
            records[kind] = KindScales(
                absmax=absmax,
                scale=float(scales.max()),
                key=scale_key(observation.attention_paths[i], kind),
                head_absmax=tuple(heads.tolist()) if per_head else None,
                head_scales=tuple(scales.tolist()) if per_head else None,
                range=chosen,
                choice=None if pick is None else pick.choice,
            )
        layers.append(LayerScales(layer=i, **records))
    return layers, warnings


def scale_tensors(layers: list[LayerScales]) -> dict[str, torch.Tensor]:
    return {
        s.key: torch.tensor(s.head_scales, dtype=torch.float32).reshape(-1, 1, 1)
        if s.head_scales is not None
        else torch.tensor([s.scale], dtype=torch.float32)
        for layer in layers
        for s in (layer.k, layer.v, layer.q)
        if s is not None
    }
