"""The model card calibrate writes: the input's README.md plus kvcalib's section between two markers, replaced on
recalibration (scales, per-layer table, validate's verdict, serve-check's commands and results).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

from kvcalib.core import fp8
from kvcalib.core.checkpoint import read_config
from kvcalib.core.mxfp4 import neuron_quantization
from kvcalib.core.schema import ATTN_HEAD, PROVENANCE_FILENAME, kv_cache_size
from kvcalib.serving.launch import (
    server_argv,  # the card's commands are serve-check's (declared: pyproject.toml)
)
from kvcalib.serving.options import ServeOptions
from kvcalib.validation.report import ValidationReport

__all__ = [
    "BEGIN",
    "CARD_FILENAME",
    "END",
    "SERVE_PORT",
    "TAGS",
    "summarize",
    "write_card",
]

CARD_FILENAME = "README.md"
CHECKPOINT_PLACEHOLDER = "/path/to/this/checkpoint"
BEGIN = "<!-- kvcalib:begin: written by `kvcalib calibrate`, replaced when it runs again -->"
END = "<!-- kvcalib:end -->"
TAGS = ("fp8", "kv-cache", "kvcalib", "vllm", "neuron", "compressed-tensors")
_SECTION = re.compile(re.escape(BEGIN.split(":", 2)[0]) + r".*?" + re.escape(END) + r"\n?", re.S)
SERVE_PORT = 8000  # the rest is serve-check's defaults: the card's commands are the ones it runs
# serve-check's variants' columns in the card: (field, format)
SERVE_COLUMNS = (
    ("nll", ".4f"),
    ("agreement", ".2f"),
    ("served_delta_nll", "+.4f"),
    ("predicted_delta_nll", "+.4f"),
)


def write_card(
    ckpt: Path, validation: str, serve: dict[str, Any] | None = None, base_model: str | None = None
) -> Path:
    """Write (atomically) `ckpt`/README.md: its current text (a card or nothing) with kvcalib's section put in or
    replaced between the markers and kvcalib's front matter merged in."""
    from huggingface_hub import ModelCard

    path = ckpt / CARD_FILENAME
    existing = path.read_text(encoding="utf-8") if path.is_file() else ""
    card = ModelCard(existing if existing.startswith("---") else "---\ntags: []\n---\n" + existing)
    body = _SECTION.sub("", card.text).rstrip()
    card.text = (body + "\n\n" if body else "") + _section(ckpt, validation, serve)
    card.data.tags = sorted(set(card.data.tags or []) | set(TAGS))
    if base_model and not getattr(card.data, "base_model", None):
        card.data.base_model = base_model
    partial = ckpt / f".{CARD_FILENAME}.partial"
    partial.write_text(str(card), encoding="utf-8")
    os.replace(
        partial, path
    )  # a hard-linked README.md from the input is replaced, never written through
    return path


_MXFP4_CHIP = next(
    name for name, chip in fp8.TARGETS.items() if chip.mxfp4
)  # the card's Trainium 3 line


def _section(ckpt: Path, validation: str, serve: dict[str, Any] | None) -> str:
    provenance = json.loads((ckpt / PROVENANCE_FILENAME).read_text(encoding="utf-8"))
    target, fp8_max = provenance["target"], provenance["fp8_max"]
    chip = fp8.TARGETS.get(
        target
    )  # the FP8 format's name from its dtype: E4M3 (float8_e4m3fn), E5M2, ...
    form = chip.dtype.removeprefix("float8_").removesuffix("fn").upper() if chip else "FP8"
    per_head, queries = (
        provenance["strategy"] == ATTN_HEAD,
        provenance["attention_scales"],
    )
    kv, added = kv_cache_size(read_config(ckpt)), provenance["special_tokens_added"]
    what = (
        "Per-KV-head FP8 KV-cache scales (`strategy: attn_head`, shape `[kv_heads, 1, 1]`)"
        if per_head
        else "Per-tensor FP8 KV-cache scales"
    )
    # whether some K/V range differs from its absmax beyond fp8.SCALE_ROUNDING_TOLERANCE (chosen), and per kind the
    # layers where a range is below its absmax (clipped)
    chosen, clipped = False, {"K": [], "V": []}
    for row in provenance["layers"]:
        for kind in "kv":
            record, pairs = row[kind], []
            if record.get("head_scales") and record.get("head_absmax"):
                pairs = [
                    (s * fp8_max, a) for s, a in zip(record["head_scales"], record["head_absmax"])
                ]
            elif record.get("range") is not None:
                pairs = [(record["range"], record["absmax"])]
            pairs = [(r, a) for r, a in pairs if a > 0]
            chosen |= any(not a <= r <= a * (1 + fp8.SCALE_ROUNDING_TOLERANCE) for r, a in pairs)
            if any(r < a * (1 - 1e-6) for r, a in pairs):
                clipped[kind.upper()].append(row["layer"])
    clipped = {kind: layers for kind, layers in clipped.items() if layers}
    # the first paragraph: what was written, how the range was chosen, what clips, where it was scored
    headroom, objective = provenance["headroom"], provenance["scale_objective"]
    wider = f"{headroom:g} x absmax(K) (--headroom)"
    text = (
        f"`k_scale = {'range' if chosen else 'absmax'}(K) / {fp8_max:g}` per "
        f"{'head' if per_head else 'layer'}, after rotary embedding (the same for V)."
    )
    if chosen and objective != "attention":
        text += f" The range is {wider}."
    elif chosen:
        text += (
            " The range (the table's range columns) is the candidate around absmax(K) with the least "
            "error in the attention block's output"
            + (f"; where it clips nothing, at least {wider}" if headroom != 1.0 else "")
            + "."
        )
    if clipped:
        text += " Clipped below absmax: " + "; ".join(
            f"{kind} in layer{'s' * (len(layers) > 1)} {', '.join(map(str, layers))}"
            for kind, layers in clipped.items()
        )
        scored = [name for name in provenance["scored_on"] if name != target]
        text += (
            f". Scored on {target} and on {', '.join(scored)}, each at its own FP8 max."
            if scored
            else f". Scored on {target} alone: serve these scales there only."
        )
    else:
        served = provenance["scored_on"] or (
            [target] if per_head else [t.name for t in fp8.served_numerics(fp8.get_target(target))]
        )
        text += f" Nothing clips: right on {', '.join(served)}."
    smaller = [t.name for t in fp8.TARGETS.values() if t.fp8_max < fp8_max]
    if smaller:
        text += (
            f" They clip on {', '.join(smaller)} (a smaller FP8 max): calibrate with --target "
            f"{smaller[0]} to serve there."
        )
    lines = [
        BEGIN,
        "## FP8 KV cache (kvcalib)",
        "",
        f"{what} sized for **{target}** ({form}, max {fp8_max:g}): {text}",
        "",
        "| | |",
        "|---|---|",
        f"| dataset | `{provenance.get('dataset')}` (split {provenance.get('split')}, column "
        f"{provenance.get('column')}) |",
        f"| samples | {provenance.get('num_samples')} (at most {provenance.get('max_seq_len')} tokens each, seed "
        f"{provenance.get('seed')}); {provenance.get('num_tokens'):,} tokens: {provenance.get('token_budget')} |",
        f"| tokens | {provenance.get('special_tokens')}"  # how the rows were tokenised
        + (f"; ids added to plain text: {added}" if added else "")
        + " |",
        f"| KV cache | {kv.describe() if kv else 'unknown (config.json lacks layers, KV heads or head_dim)'} |",
        f"| kvcalib | {provenance.get('kvcalib_version')}, engine {provenance.get('engine')} |",
        f"| validate | {validation} |",
        "",
    ]
    mxfp4 = bool(provenance.get("mxfp4_weights"))

    def command(device: str) -> str:  # the vLLM command serve-check runs
        argv = server_argv(
            ServeOptions(device, vllm_python=Path("python")),
            Path(CHECKPOINT_PLACEHOLDER),
            SERVE_PORT,
            True,
            neuron_quantization=neuron_quantization(device) if mxfp4 else None,
        )
        return f"```bash\n{shlex.join(argv)}\n```"

    trn3 = json.dumps({"neuron_config": {"quantization": neuron_quantization(_MXFP4_CHIP)}})
    paragraphs = [
        (True, "### Serving it"),
        (
            per_head,
            "GPU vLLM reads per-head scales on its FlashAttention backend; vLLM on Neuron cannot load them.",
        ),
        (
            queries,
            "`q_scale` (Q after rotary embedding) and the FP8-attention config group are for GPU vLLM's FP8 "
            "attention; the Neuron plugin does not read them.",
        ),
        (
            not per_head,
            "vLLM on Neuron (Trainium 2"
            + ("" if mxfp4 else "; `trn3` is the same command")
            + "), as `kvcalib serve-check CKPT --device trn2` "
            f"runs it (set `--tensor-parallel-size` to your NeuronCores, and `{CHECKPOINT_PLACEHOLDER}` to where "
            f"it is):\n\n{command(fp8.DEFAULT_TARGET)}",
        ),
        (
            mxfp4,
            f"On Trainium 3 the same with `--additional-config '{trn3}'`: its GPT-OSS model runs the MXFP4 "
            "experts as they are (on Trainium 2 it dequantizes them at load).\n\n"
            "Not for GPU: the experts stay MXFP4, which GPU vLLM loads only under its MXFP4 config, and that "
            "reads no KV scales (FP8 KV at 1.0). For GPU calibrate the dequantised form (`dequantize_mxfp4`, "
            "then `--target gpu`).",
        ),
        (
            not mxfp4,
            f"vLLM on GPU (`kvcalib serve-check CKPT --device cuda`):\n\n{command('cuda')}",
        ),
    ]
    lines += [line for shown, text in paragraphs if shown for line in (text, "")]
    if serve is not None:
        verdict = (
            "passed" if serve.get("ok") else "FAILED: " + "; ".join(serve.get("failures") or [])
        )
        lines += [
            "### serve-check",
            "",
            f"`kvcalib calibrate --serve-check {serve.get('device')}` on {serve.get('vllm')}: {verdict}.",
            "",
            "| scales | NLL | agreement | served ΔNLL | predicted ΔNLL |",
            "|---|---:|---:|---:|---:|",
            *(
                "| "
                + " | ".join(
                    [row["name"]]
                    + ["-" if row[k] is None else format(row[k], f) for k, f in SERVE_COLUMNS]
                )
                + " |"
                for row in serve.get("variants") or []
            ),
            *(["", f"Canary: {serve['canary']['reason']}."] if serve.get("canary") else []),
            "",
        ]
    fields = [
        ("k", "absmax"),
        ("v", "absmax"),
        *((("k", "range"), ("v", "range")) if chosen else ()),
        ("k", "scale"),
        ("v", "scale"),
        *((("q", "absmax"), ("q", "scale")) if queries else ()),
    ]
    lines += [
        "### Scales",
        "",
        *(
            ["Each layer's largest head; every head's in `kvcalib_calibration.json`.", ""]
            if per_head
            else []
        ),
        "| layer | "
        + " | ".join(f"{k}_scale" if f == "scale" else f"{k} {f}" for k, f in fields)
        + " |",
        "|---:|" + "---:|" * len(fields),
    ]
    # per layer and kind: absmax, range (absmax where none was chosen) and scale (per head: the largest), as recorded
    lines += [
        f"| {row['layer']} | "
        + " | ".join(
            f"{({'range': row[k]['absmax'], **row[k]} if k in row else {}).get(f, math.nan):.6g}"
            for k, f in fields
        )
        + " |"
        for row in sorted(provenance["layers"], key=lambda row: row["layer"])
    ]
    return "\n".join(lines + ["", END, ""])


def summarize(report: ValidationReport) -> str:
    """validate's verdict in a line."""
    return (
        f"{'OK' if report.ok else 'FAILED'} for {report.target}: "
        f"{len(report.errors)} error(s), {len(report.warnings)} warning(s)"
    )
