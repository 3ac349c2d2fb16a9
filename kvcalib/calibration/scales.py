"""Observation -> scales: per tensor or per KV head (strategy), K/V and optionally Q, and the tensors
written for them.

Shapes are llm-compressor's (compressed-tensors' initialize_qparams) and what vLLM's
compressed-tensors loader reads: `[1]` per tensor; `[heads, 1, 1]` per head (KV heads for K/V,
attention heads for Q), which vLLM flattens (and for Q reduces to one max per KV head group).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvcalib.calibration.engine import Observation
from kvcalib.calibration.objective import Candidates, KindChoice
from kvcalib.calibration.options import LayerScales
from kvcalib.core import fp8
from kvcalib.core.errors import CalibrationError
from kvcalib.core.schema import ATTN_HEAD, scale_key

__all__ = ["layer_scales", "scale_tensors", "with_headroom"]


def _check_finite(kind: str, per_layer: list[torch.Tensor], warnings: list[str]) -> None:
    for i, heads in enumerate(per_layer):
        value = float(heads.max())  # NaN and inf propagate through max
        if not math.isfinite(value):
            raise CalibrationError(
                f"layer {i}: {kind} absmax is {value} (overflow in the calibration dtype)",
                hint="calibrate with --dtype bfloat16 or --dtype float32",
            )
        if value == 0.0:
            warnings.append(f"layer {i}: {kind} was exactly zero on every token; its scale is floored at {fp8.SCALE_FLOOR}")


def _unobserved(counts: tuple[int, ...], model_dir: Path, what: str) -> None:
    missing = [i for i, n in enumerate(counts) if n == 0]
    if missing:
        raise CalibrationError(
            f"{model_dir}: decoder layer(s) {missing} {what} never observed during calibration",
            hint="the model's attention does not go through transformers' attention interface for these layers",
        )


def with_headroom(head_scales: torch.Tensor, heads: torch.Tensor, headroom: float, target: fp8.Target) -> torch.Tensor:
    """Each head's scale raised to cover headroom x its absmax, unless the scale clips that absmax (a deliberate clip
    of the scale objective stays as chosen). FP8 is a floating-point grid: a wider scale keeps the relative
    precision of every value in the normal range and only moves the smallest toward the subnormals."""
    if headroom == 1.0:
        return head_scales
    keeps = head_scales >= fp8.scale_from_absmax(heads, target)
    return torch.where(keeps, torch.maximum(head_scales, fp8.scale_from_absmax(heads * headroom, target)), head_scales)


def layer_scales(observation: Observation, target: fp8.Target, model_dir: Path, strategy: str = "tensor",
                 queries: bool = False, choices: list[tuple[KindChoice, KindChoice, Candidates, Candidates]] | None = None,
                 headroom: float = 1.0) -> tuple[list[LayerScales], list[str]]:
    """Per-layer scales for `target`, with per-head values when `strategy` is attn_head and Q's when `queries`:
    absmax / fp8_max, or for K and V the scale objective's `choices` (kvcalib.calibration.objective.search); K and V
    scales that clip nothing then cover `headroom` x absmax (with_headroom)."""
    _unobserved(observation.observed, model_dir, "were")
    if queries:
        _unobserved(observation.q_observed, model_dir, "had their Q")
    warnings: list[str] = []
    kinds = {"K": list(observation.k_heads), "V": list(observation.v_heads)}
    if queries:
        kinds["Q"] = list(observation.q_heads)
    for kind, per_layer in kinds.items():
        _check_finite(kind, per_layer, warnings)
    per_head = strategy == ATTN_HEAD
    layers = []
    for i in range(len(observation.observed)):
        fields: dict = {"layer": i}
        for kind, per_layer in kinds.items():
            k = kind.lower()
            heads = per_layer[i].float()
            head_scales = fp8.scale_from_absmax(heads, target)
            fields[f"{k}_absmax"] = float(heads.max())
            if choices is not None and k in "kv":
                choice, cands = choices[i][0 if k == "k" else 1], choices[i][2 if k == "k" else 3]
                picked = choice.index * heads.numel() if len(choice.index) == 1 else choice.index
                head_scales = torch.stack([cands.scales[c, h] for h, c in enumerate(picked)])
                ranges = torch.stack([cands.ranges[c, h] for h, c in enumerate(picked)])
                fields[f"{k}_range"] = float(ranges[int(head_scales.argmax())])
                fields[f"{k}_choice"] = choice.to_dict()
            if k in "kv" and headroom != 1.0:
                head_scales = with_headroom(head_scales, heads, headroom, target)
                fields[f"{k}_range"] = float(head_scales.max()) * target.fp8_max
            fields[f"{k}_scale"] = float(head_scales.max())  # scale_from_absmax is monotone: the max's scale
            fields[f"{k}_key"] = scale_key(observation.attention_paths[i], k)
            if per_head:
                fields[f"{k}_head_absmax"] = tuple(heads.tolist())
                fields[f"{k}_head_scales"] = tuple(head_scales.tolist())
        layers.append(LayerScales(**fields))
    return layers, warnings


def scale_tensors(layers: list[LayerScales]) -> dict[str, torch.Tensor]:
    """The float32 tensors to write: [1] per tensor, [heads, 1, 1] per head."""
    scales: dict[str, torch.Tensor] = {}
    for layer in layers:
        for k in ("k", "v", "q"):
            key = getattr(layer, f"{k}_key")
            if key is None:
                continue
            heads = getattr(layer, f"{k}_head_scales")
            scales[key] = (torch.tensor(heads, dtype=torch.float32).reshape(-1, 1, 1) if heads is not None
                           else torch.tensor([getattr(layer, f"{k}_scale")], dtype=torch.float32))
    return scales
