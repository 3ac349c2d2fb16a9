"""The scales eval runs with: one configuration per checkpoint (or `unit`), per tensor or per head, K/V
and, where the checkpoint has them, Q (FP8 attention)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvcalib.core.checkpoint import read_scale_values, scan_checkpoint
from kvcalib.core.errors import UsageError
from kvcalib.core.schema import neuron_scale_key
from kvcalib.evaluation.emulate import Scale

__all__ = ["ScaleSet", "read_scale_set"]


@dataclass(frozen=True)
class ScaleSet:
    """Per layer: K, V (and Q) scales, each a float or [1, heads, 1, 1]."""

    k: list[Scale]
    v: list[Scale]
    q: list[Scale] | None  # None: the checkpoint has no q_scale


def read_scale_set(
    ckpt_dir: Path, num_layers: int, kv_heads: int | None, q_heads: int | None
) -> ScaleSet:
    """The checkpoint's model.layers.{i}.self_attn.{k,v,q}_scale: shape [1], or one per head. Per-head Q is reduced
    as GPU vLLM's loader does (max over each KV head's query group: FlashAttention takes one q scale per KV head),
    then spread back over the query heads."""
    files = scan_checkpoint(ckpt_dir)
    found = {"k": [], "v": [], "q": []}
    for kind, heads in (("k", kv_heads), ("v", kv_heads), ("q", q_heads)):
        for layer in range(num_layers):
            key = neuron_scale_key(layer, kind)
            values = read_scale_values(ckpt_dir, files, key, required=kind != "q")
            if values is None:  # no q_scale: a KV-only checkpoint
                break
            if len(values) not in (1, heads):
                raise UsageError(
                    f"{ckpt_dir}: {key} has {len(values)} values; the model has {heads} heads",
                    hint=f"run `kvcalib validate {ckpt_dir} --target gpu`",
                )
            if kind == "q" and len(values) != 1 and kv_heads:
                group = len(values) // kv_heads
                values = [
                    max(values[g * group : (g + 1) * group])
                    for g in range(kv_heads)
                    for _ in range(group)
                ]
            found[kind].append(  # a float for one value, [1, H, 1, 1] for one per head
                float(values[0])
                if len(values) == 1
                else torch.tensor(values, dtype=torch.float32).reshape(1, -1, 1, 1)
            )
    q = found["q"] if len(found["q"]) == num_layers else None
    if found["q"] and q is None:
        raise UsageError(
            f"{ckpt_dir}: q_scale on {len(found['q'])} of {num_layers} layers",
            hint="recalibrate with kvcalib calibrate --attention-scales",
        )
    return ScaleSet(found["k"], found["v"], q)
