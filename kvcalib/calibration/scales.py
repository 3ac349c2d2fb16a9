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
from kvcalib.core.schema import ATTN_HEAD, scale_key

__all__ = ["layer_scales", "scale_tensors", "written_scales"]


def _check_finite(kind: str, per_layer: list[torch.Tensor], warnings: list[str]) -> None:
    for i, heads in enumerate(per_layer):
        value = float(heads.max())  # NaN and inf propagate through max
        if not math.isfinite(value):
            raise CalibrationError(
                f"layer {i}: {kind} absmax is {value} (overflow in the calibration dtype)",
                hint="calibrate with --dtype bfloat16 or --dtype float32",
            )
        if value == 0.0:
            warnings.append(
                f"layer {i}: {kind} was exactly zero on every token; its scale is floored at "
                f"{fp8.SCALE_FLOOR}"
            )


def _unobserved(counts: tuple[int, ...], model_dir: Path, what: str) -> None:
    missing = [i for i, n in enumerate(counts) if n == 0]
    if missing:
        raise CalibrationError(
            f"{model_dir}: decoder layer(s) {missing} {what} never observed during calibration",
            hint="the model's attention does not go through transformers' attention interface for these layers",
        )


def written_scales(
    head_scales: torch.Tensor,
    heads: torch.Tensor,
    headroom: float,
    target: fp8.Target,
    per_head: bool,
) -> torch.Tensor:
    """The scales written for a K/V (or Q) whose chosen scale per head is `head_scales` and absmax per head `heads`:
    per head, each head's; per tensor, one ([1]), their max. A scale that keeps the absmax (per tensor: the tensor's)
    is raised to cover headroom x it; a clip stays a clip. A wider FP8 scale keeps the relative precision of normal
    values; only the smallest become subnormal."""
    if not per_head:
        head_scales, heads = head_scales.max().reshape(1), heads.max().reshape(1)
    if headroom == 1.0:
        return head_scales
    keeps = head_scales >= fp8.scale_from_absmax(heads, target)
    return torch.where(
        keeps,
        torch.maximum(head_scales, fp8.scale_from_absmax(heads * headroom, target)),
        head_scales,
    )


def layer_scales(
    observation: Observation,
    target: fp8.Target,
    model_dir: Path,
    strategy: str = "tensor",
    queries: bool = False,
    choices: list[tuple[Scored, Scored]] | None = None,
    headroom: float = 1.0,
) -> tuple[list[LayerScales], list[str]]:
    """Per-layer scales: absmax / fp8_max, or for K/V the objective's `choices`; as written_scales writes them."""
    _unobserved(observation.observed, model_dir, "were")
    kinds = {"k": list(observation.k_heads), "v": list(observation.v_heads)}
    if queries:
        _unobserved(observation.q_observed, model_dir, "had their Q")
        kinds["q"] = list(observation.q_heads)
    warnings: list[str] = []
    for kind, per_layer in kinds.items():
        _check_finite(kind.upper(), per_layer, warnings)
    layers = []
    for i in range(len(observation.observed)):
        picks = dict(zip("kv", choices[i])) if choices is not None else {}
        records = {
            kind: _kind_scales(
                per_layer[i].float(),
                target,
                scale_key(observation.attention_paths[i], kind),
                strategy == ATTN_HEAD,
                picks.get(kind),
                1.0 if kind == "q" else headroom,
            )
            for kind, per_layer in kinds.items()
        }
        layers.append(LayerScales(layer=i, **records))
    return layers, warnings


def _kind_scales(
    heads: torch.Tensor,
    target: fp8.Target,
    key: str,
    per_head: bool,
    pick: Scored | None,
    headroom: float,
) -> KindScales:
    head_scales, chosen = fp8.scale_from_absmax(heads, target), None
    if pick is not None:
        index = pick.index * heads.numel() if len(pick.index) == 1 else pick.index
        head_scales = torch.stack([pick.candidates.scales[c, h] for h, c in enumerate(index)])
        chosen = float(
            torch.stack([pick.candidates.ranges[c, h] for h, c in enumerate(index)])[
                int(head_scales.argmax())
            ]
        )
    written = written_scales(head_scales, heads, headroom, target, per_head)
    if headroom != 1.0:
        chosen = float(written.max()) * target.fp8_max
    return KindScales(
        absmax=float(heads.max()),
        scale=float(written.max()),
        key=key,
        head_absmax=tuple(heads.tolist()) if per_head else None,
        head_scales=tuple(written.tolist()) if per_head else None,
        range=chosen,
        choice=None if pick is None else pick.choice,
    )


def scale_tensors(layers: list[LayerScales]) -> dict[str, torch.Tensor]:
    return {
        s.key: torch.tensor(s.head_scales, dtype=torch.float32).reshape(-1, 1, 1)
        if s.head_scales is not None
        else torch.tensor([s.scale], dtype=torch.float32)
        for layer in layers
        for s in layer.kinds().values()
    }
