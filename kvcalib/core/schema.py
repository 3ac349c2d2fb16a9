"""Names and schemas: the one place that builds scale tensor keys (`model.layers.{i}.self_attn.k_scale`), file names
and the KV-only compressed-tensors `quantization_config`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ATTN_HEAD",
    "CONFIG_FILENAME",
    "INDEX_FILENAME",
    "KV_KINDS",
    "KvCacheSize",
    "NEURON_ALT_LAYERS_PREFIX",
    "NEURON_LAYERS_PREFIX",
    "NEURON_PER_HEAD_REASON",
    "PROVENANCE_FILENAME",
    "PROVENANCE_METADATA_KEY",
    "SCALES_FILENAME",
    "SINGLE_WEIGHTS_FILENAME",
    "TENSOR",
    "attention_groups",
    "fp8_attention_groups",
    "head_counts",
    "head_dim",
    "is_attention_target",
    "is_kv_scale_key",
    "kv_cache_scheme_args",
    "kv_cache_size",
    "kv_only_quantization_config",
    "max_position_embeddings",
    "neuron_scale_key",
    "num_hidden_layers",
    "parse_foreign_scale_key",
    "parse_kv_scheme",
    "parse_scale_key",
    "scale_key",
    "text_config",
]

KV_KINDS = ("k", "v")

# Files kvcalib adds to a checkpoint directory.
SCALES_FILENAME = "kv_scales.safetensors"
PROVENANCE_FILENAME = "kvcalib_calibration.json"
CONFIG_FILENAME = "config.json"
INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILENAME = "model.safetensors"
# the scale file's safetensors metadata key holding the provenance JSON
PROVENANCE_METADATA_KEY = "kvcalib"

# The decoder-layer prefix every Neuron scale loader reads (vllm-neuron's models, _load_kv_cache_scales; one fork
# of a multimodal model reads the language_model one).
NEURON_LAYERS_PREFIX = "model.layers"
NEURON_ALT_LAYERS_PREFIX = "model.language_model.layers"

# KV-cache scale strategies (llm-compressor's names): one scale per layer, or one per KV head.
TENSOR = "tensor"
ATTN_HEAD = "attn_head"

# Why per-head KV scales (kv_cache_scheme strategy attn_head) cannot serve on Neuron.
NEURON_PER_HEAD_REASON = (
    "vLLM on Neuron reads one k_scale and one v_scale per layer, and its loader's reshape "
    "to [1, 1] crashes on a per-head scale (RuntimeError: shape '[1, 1]' is invalid)"
)

MAX_LAYERS = 10_000  # far more than any model has; bounds the loop over a hostile config


def num_hidden_layers(config: dict[str, Any]) -> int | None:
    """config.json's num_hidden_layers, top level or under text_config (multimodal configs); None if unusable."""
    found = (holder.get("num_hidden_layers") for holder in (config, text_config(config)))
    return next((n for n in found if type(n) is int and 0 <= n <= MAX_LAYERS), None)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of config.json: text_config in a multimodal config, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def max_position_embeddings(config: dict[str, Any]) -> int | None:
    """The longest context the model serves (max_position_embeddings, top level or text_config); None if unusable."""
    return _positive_int(text_config(config).get("max_position_embeddings"))


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def head_counts(config: dict[str, Any]) -> dict[str, int | None]:
    """kind -> scales in a per-head tensor: KV heads for k/v, attention heads for q (None: not said)."""
    text = text_config(config)
    q = _positive_int(text.get("num_attention_heads"))
    kv = _positive_int(text.get("num_key_value_heads")) or q
    return {"k": kv, "v": kv, "q": q}


def head_dim(config: dict[str, Any]) -> int | None:
    """head_dim, else hidden_size / num_attention_heads (top level or text_config); None if not said."""
    text = text_config(config)
    hidden, heads = (
        _positive_int(text.get("hidden_size")),
        _positive_int(text.get("num_attention_heads")),
    )
    return _positive_int(text.get("head_dim")) or (hidden // heads if hidden and heads else None)


KV_VALUE_BYTES = {"bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class KvCacheSize:
    """KV-cache bytes by dtype ({"bf16", "fp8"}; calibrate's kv_cache): per_token, context (max positions) and sequence
    (null: unknown), windowed (sliding-window layers at min(window, context); null: none), window, sliding_layers."""

    per_token: dict[str, int]
    context: int | None
    sequence: dict[str, int] | None
    windowed: dict[str, int] | None = None
    window: int | None = None
    sliding_layers: int = 0

    def describe(self) -> str:
        text = f"{self.per_token['bf16']:,} B/token bf16, {self.per_token['fp8']:,} FP8"
        if self.sequence:
            text += f"; one {self.context:,}-token sequence (max_position_embeddings): {_gb(self.sequence)}"
        if self.windowed:
            text += (
                f" (its {self.sliding_layers} sliding-window layers holding {min(self.window, self.context):,} "
                f"tokens: {_gb(self.windowed)})"
            )
        return text


def _gb(sizes: dict[str, int]) -> str:
    return f"{sizes['bf16'] / 1e9:.2f} GB bf16, {sizes['fp8'] / 1e9:.2f} GB FP8"


def kv_cache_size(config: dict[str, Any]) -> KvCacheSize | None:
    """2 x layers x KV heads x head_dim x bytes per value, per token and sequence; sliding-window layers from
    layer_types (GPT-OSS, Gemma-3). None when config.json does not say its layers, KV heads and head_dim."""
    layers, heads, size = num_hidden_layers(config), head_counts(config)["k"], head_dim(config)
    if not (layers and heads and size):
        return None
    context, window = (
        max_position_embeddings(config),
        _positive_int(text_config(config).get("sliding_window")),
    )
    types = text_config(config).get("layer_types")
    sliding = (
        sum(t == "sliding_attention" for t in types)
        if window and isinstance(types, list) and len(types) == layers
        else 0
    )

    def held(tokens: int) -> dict[str, int] | None:
        return (
            {dtype: 2 * heads * size * width * tokens for dtype, width in KV_VALUE_BYTES.items()}
            if tokens
            else None
        )

    windowed = (
        (layers - sliding) * context + sliding * min(window, context) if sliding and context else 0
    )
    return KvCacheSize(
        held(layers),
        context,
        held(layers * (context or 0)),
        held(windowed),
        window if sliding else None,
        sliding,
    )


def scale_key(attention_module_path: str, kind: str) -> str:
    """`<attention module path>.k_scale` / `.v_scale` / `.q_scale`: the attention module's own state-dict name."""
    return f"{attention_module_path}.{kind}_scale"


def neuron_scale_key(layer: int, kind: str, layers_prefix: str = NEURON_LAYERS_PREFIX) -> str:
    """The exact key vLLM on Neuron reads for layer `layer`."""
    return scale_key(f"{layers_prefix}.{layer}.self_attn", kind)


_SCALE_RE = re.compile(r"^(.*\.layers)\.(\d+)\.self_attn\.([kvq])_scale$")
# Names other tools have used for KV scales that the Neuron loader does NOT read: k_proj/v_proj.output_scale
# (pre-2024 llm-compressor), k_proj/v_proj.*_scale, self_attn.attn.*_scale (vLLM's module path), and one kv_scale
# for K and V (under self_attn or self_attn.attn).
_FOREIGN_SCALE_RE = re.compile(
    r"^.*\.layers\.(\d+)\.self_attn\.(?:([kv])_proj\.(?:output|[kv])_scale|attn\.([kv])_scale|(?:attn\.)?kv_scale)$"
)


def parse_scale_key(key: str) -> tuple[str, int, str] | None:
    """(layers prefix, layer, 'k'|'v'|'q') for a `*.layers.{i}.self_attn.{k,v,q}_scale` key."""
    m = _SCALE_RE.match(key)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def parse_foreign_scale_key(key: str) -> tuple[int, str | None] | None:
    """(layer, kind or None: one scale for both) for a KV scale under a name Neuron ignores."""
    m = _FOREIGN_SCALE_RE.match(key)
    return (int(m.group(1)), m.group(2) or m.group(3)) if m else None


def is_kv_scale_key(key: str) -> bool:
    """Any KV-cache scale, under the Neuron name or a foreign one, or an attention layer's q_scale (FP8 attention)."""
    return parse_scale_key(key) is not None or parse_foreign_scale_key(key) is not None


# The kv_cache_scheme fields written: older compressed-tensors versions forbid unknown keys
# (compressed_tensors/quantization/quant_args.py), so only fields every version since 0.11 knows.
_KV_SCHEME_FIELDS = ("num_bits", "type", "strategy", "dynamic", "symmetric", "observer")


def kv_cache_scheme_args(strategy: str = "tensor") -> Any:
    """compressed-tensors `QuantizationArgs` for static FP8 KV per layer (tensor) or KV head (attn_head)."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=8,
        type="float",
        strategy=strategy,
        dynamic=False,
        symmetric=True,
        observer="static_minmax",
    )


def parse_kv_scheme(scheme: Any) -> Any:
    """A kv_cache_scheme parsed by compressed-tensors' `QuantizationArgs`; where it refuses it, ValueError with
    pydantic's first three errors as `field: message`."""
    from compressed_tensors.quantization import QuantizationArgs

    try:
        return QuantizationArgs.model_validate(scheme)
    except (
        ValueError,
        TypeError,
        NotImplementedError,
    ) as exc:  # pydantic's ValidationError is a ValueError
        errors = exc.errors() if callable(getattr(exc, "errors", None)) else [{"msg": str(exc)}]
        raise ValueError(
            "; ".join(
                ".".join(map(str, e.get("loc", ())))
                + (": " if e.get("loc") else "")
                + str(e["msg"]).removeprefix("Value error, ")
                for e in errors[:3]
            )
        ) from None


# llm-compressor's FP8-attention config group: input activations of the attention class, e.g. {"attention":
# {"targets": ["LlamaAttention"], "input_activations": ...}}. GPU vLLM recognises it only with exactly one target
# ending in "Attention" (vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py,
# CompressedTensorsConfig.from_config); the Neuron validator's looser test lives in kvcalib.validation.config.
ATTENTION_GROUP = "attention"


def is_attention_target(target: Any) -> bool:
    """A config group's target naming an attention class: ends in "Attention", GPU vLLM's test."""
    return isinstance(target, str) and target.endswith("Attention")


def attention_groups(groups: Any) -> dict[str, list[Any]]:
    """name -> targets of every group quantising only input activations of an attention target."""
    return {
        name: g["targets"]
        for name, g in (groups.items() if isinstance(groups, dict) else ())
        if isinstance(g, dict)
        and g.get("input_activations")
        and not g.get("weights")
        and isinstance(g.get("targets"), list)
        and any(is_attention_target(t) for t in g["targets"])
    }


def fp8_attention_groups(groups: Any) -> dict[str, Any]:
    """name -> input_activations of the well-formed FP8-attention groups (only attention targets)."""
    return {
        name: groups[name]["input_activations"]
        for name, targets in attention_groups(groups).items()
        if not groups[name].get("output_activations")
        and all(is_attention_target(t) for t in targets)
    }


def kv_only_quantization_config(
    strategy: str = "tensor", attention_classes: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The KV `quantization_config` for config.json, its kv_cache_scheme dumped by compressed-tensors' models and the
    whole read back by `QuantizationConfig.model_validate`; with `attention_classes`, one FP8-attention group per
    class."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig

    dumped = kv_cache_scheme_args(strategy).model_dump(mode="json")
    scheme = {k: dumped[k] for k in _KV_SCHEME_FIELDS}
    names = (
        [ATTENTION_GROUP]
        if len(attention_classes) == 1
        else [f"{ATTENTION_GROUP}_{c}" for c in attention_classes]
    )
    config = {
        "config_groups": {
            name: {
                "targets": [cls],
                "weights": None,
                "input_activations": dict(scheme),
                "output_activations": None,
            }
            for name, cls in zip(names, attention_classes)
        },
        "format": "dense",
        "ignore": [],
        "kv_cache_scheme": scheme,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    QuantizationConfig.model_validate(config)
    return {**config, "version": compressed_tensors.__version__}
