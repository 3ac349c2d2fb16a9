"""Per-head KV scales and Q scales (FP8 attention): GPU vLLM's compressed-tensors loader flattens llm-compressor's
per-head `[kv_heads, 1, 1]` K/V scales (strategy attn_head) to `[num_kv_heads]` (FlashAttention only) and reads
`self_attn.q_scale`, `[1]` per tensor, `[attention_heads, 1, 1]` per head; Neuron reads k_scale and v_scale only."""

from __future__ import annotations

import math
from typing import Any

from kvcalib.core import checkpoint
from kvcalib.core.checkpoint import CheckpointFiles
from kvcalib.core.errors import KvcalibError
from kvcalib.core.fp8 import get_target
from kvcalib.core.schema import (
    NEURON_ALT_LAYERS_PREFIX,
    NEURON_LAYERS_PREFIX,
    attention_groups,
    head_counts,
    is_attention_target,
    num_hidden_layers,
    parse_scale_key,
)
from kvcalib.validation.config import QCFG_LOCATION
from kvcalib.validation.report import ERROR, INFO, WARNING, Finding

__all__ = ["attention_group_findings", "per_head_findings", "query_findings"]


def per_head_findings(
    header: checkpoint.SafetensorsHeader, key: str, kind: str, expected: int | None, location: str
) -> tuple[list[Finding], list[float] | None]:
    """A per-head scale for GPU vLLM: one value per head, each finite and > 0; (findings, its values)."""
    info = header.tensors[key]
    numel, what = math.prod(info.shape), "KV heads" if kind in ("k", "v") else "attention heads"
    # [1]: vLLM broadcasts
    if expected is not None and numel != expected and not (numel == 1 and kind != "q"):
        return [
            Finding(
                "SCALE-HEADS" if kind != "q" else "SCALE-Q-SHAPE",
                ERROR,
                f"{key} has shape {list(info.shape)} ({numel} values) but the model has {expected} {what}: GPU vLLM's "
                f"per-head loader copies it into [{expected if kind != 'q' else 'num_kv_heads'}] and fails",
                f"write one scale per head, shape [{expected}, 1, 1] (llm-compressor's layout)",
                location,
            )
        ], None
    try:
        values = checkpoint.read_values(header, key)
    except KvcalibError as exc:
        return [Finding("SCALE-UNREADABLE", ERROR, exc.message, exc.hint, location)], None
    bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v) or v <= 0]
    if bad:
        listed = ", ".join(f"head {i} = {v!r}" for i, v in bad[:4])
        return [
            Finding(
                "SCALE-HEADS" if kind != "q" else "SCALE-Q-VALUE",
                ERROR,
                f"{key}: {listed}{' ...' if len(bad) > 4 else ''}: every scale must be finite and > 0",
                "recalibrate; a head that saw only zeros still needs a tiny positive scale",
                location,
            )
        ], None
    return [], values


def declared_attention_groups(config: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, targets) of every config group that declares FP8 attention (core.schema.attention_groups)."""
    qc = config.get("quantization_config")
    return list(attention_groups(qc.get("config_groups") if isinstance(qc, dict) else None).items())


def attention_group_findings(config: dict[str, Any], target: str) -> list[Finding]:
    """PORT-ATTENTION-GROUP: GPU vLLM skips an attention group only when it has one target ending in Attention."""
    if get_target(target).neuron:
        return []
    return [
        Finding(
            "PORT-ATTENTION-GROUP",
            WARNING,
            f"config_groups['{name}'] quantises attention inputs with targets {targets!r}: GPU vLLM recognises an "
            "FP8-attention group only with exactly one target whose name ends in 'Attention', and otherwise "
            "treats it as a linear-layer scheme",
            'one group per attention class, e.g. {"targets": ["LlamaAttention"], "input_activations": {...}}',
            f"{QCFG_LOCATION}.config_groups.{name}",
        )
        for name, targets in declared_attention_groups(config)
        if not (len(targets) == 1 and is_attention_target(targets[0]))
    ]


def query_findings(
    config: dict[str, Any], scan: CheckpointFiles, target: str, per_head: bool
) -> list[Finding]:
    """q_scale: information on Neuron (not read); on gpu, present on every layer when FP8 attention is declared."""
    # layer -> its q_scale key under either prefix Neuron reads (the first in sorted order)
    parsed = ((key, parse_scale_key(key)) for key in sorted(scan.key_files, reverse=True))
    keys = {
        p[1]: key
        for key, p in parsed
        if p and p[0] in (NEURON_LAYERS_PREFIX, NEURON_ALT_LAYERS_PREFIX) and p[2] == "q"
    }
    if get_target(target).neuron:
        if not keys:
            return []
        return [
            Finding(
                "SCALE-Q-UNUSED",
                INFO,
                f"q_scale on {len(keys)} layer(s) (FP8 attention): not consumed by the plugin today; "
                "vLLM on Neuron reads k_scale and v_scale only, so Q stays in bf16 there",
                "nothing to do: GPU vLLM's FP8 attention reads q_scale; Neuron ignores it",
                keys[min(keys)],
            )
        ]
    findings = []
    n_layers = num_hidden_layers(config)
    if declared_attention_groups(config) and n_layers is not None:
        missing = [i for i in range(n_layers) if i not in keys]
        if missing:
            findings.append(
                Finding(
                    "SCALE-Q-MISSING",
                    WARNING,
                    f"quantization_config declares FP8 attention but layer(s) {missing[:8]}"
                    f"{' ...' if len(missing) > 8 else ''} have no self_attn.q_scale: GPU vLLM quantises their Q with "
                    "scale 1.0",
                    "recalibrate with kvcalib calibrate --attention-scales",
                    QCFG_LOCATION,
                )
            )
    expected = head_counts(config)["q"] if per_head else 1
    for key in keys.values():
        header = scan.header_of(key)  # a key of the scan: its file's header is there
        location, numel = f"{header.path.name}:{key}", math.prod(header.tensors[key].shape)
        if not per_head and numel != 1:
            findings.append(
                Finding(
                    "SCALE-Q-SHAPE",
                    ERROR,
                    f"{key} has {numel} values but kv_cache_scheme is per "
                    "tensor: GPU vLLM's loader expects one",
                    "write q_scale with shape [1]",
                    location,
                )
            )
            continue
        findings += per_head_findings(header, key, "q", expected, location)[0]
    return findings
