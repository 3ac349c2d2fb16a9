"""The model side shared by calibrate and eval: resolve, check and load a checkpoint with transformers, and the
choices made from the command line's words (target, dtype, device, compute path)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcalib.core import fp8, mxfp4, schema
from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.cpu import ComputePath, HostCpu, choose_compute
from kvcalib.core.errors import (
    CheckpointNotFoundError,
    CheckpointReadError,
    UnknownTargetError,
    UnsupportedModelError,
    UsageError,
)
from kvcalib.core.options import RunOptions
from kvcalib.core.paths import require_regular_file
from kvcalib.core.schema import INDEX_FILENAME, fp8_attention_groups, is_kv_scale_key
from kvcalib.hf import internals
from kvcalib.hf.mxfp4 import expert_chunks

__all__ = [
    "PreparedRun",
    "check_loading_info",
    "faithful_attention",
    "prepare_run",
    "build_skeleton",
    "effective_dtype",
    "load_model",
    "load_tokenizer",
    "num_layers",
    "pad_id",
    "resolve_compute",
    "resolve_model_dir",
    "resolve_target",
    "text_config",
]


@dataclass(frozen=True)
class PreparedRun:
    """The checked model side of a run, before any weight is loaded."""

    checkpoint: Checkpoint
    dtype: torch.dtype | None  # None: the checkpoint's own
    device: torch.device


def prepare_run(model: str | Path, options: RunOptions) -> PreparedRun:
    """--dtype (auto: None) and --device (checked again: lm-eval's model_args reach here unchecked), then the
    checkpoint: found, read once, a causal LM kvcalib can run."""
    if options.dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise UsageError(
            f"unknown --dtype {options.dtype!r}", hint="use auto, bfloat16, float16 or float32"
        )
    try:
        device = torch.device(options.device)
    except RuntimeError:
        raise UsageError(f"unknown --device {options.device!r}", hint="use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda was asked for but torch sees no CUDA device", hint="use --device cpu"
        )
    checkpoint = Checkpoint.open(resolve_model_dir(model))
    # a causal LM, unquantised (or KV-only), with safetensors weights
    causal_names = internals.causal_lm_names()

    model_dir, config = checkpoint.root, checkpoint.config
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    remote = options.trust_remote_code and "AutoModelForCausalLM" in (config.get("auto_map") or {})
    causal = (
        any(
            isinstance(a, str) and (a in causal_names.values() or a.endswith("ForCausalLM"))
            for a in architectures
        )
        if architectures
        else model_type in causal_names
    )
    if not (causal or remote):
        raise UnsupportedModelError(
            f"{model_dir}: model_type {model_type!r} (architectures {config.get('architectures')}) is not a causal "
            "language model transformers can load with AutoModelForCausalLM",
            hint="kvcalib calibrates decoder-only LLMs (Llama, Qwen3, Mistral, ...)",
        )
    qcfg = config.get("quantization_config") or config.get("compression_config")
    if qcfg:
        qcfg = qcfg if isinstance(qcfg, dict) else {}
        method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")
        groups = qcfg.get("config_groups")
        # MXFP4 experts are calibrated as they are (core.mxfp4: only --target gpu is refused, by calibrate);
        # FP8-attention groups only (kvcalib calibrate --attention-scales): the weights are unquantised
        released_mxfp4 = "mxfp4" in method and mxfp4.weights(checkpoint.files.key_files)
        if not released_mxfp4 and (
            method != "compressed-tensors"
            or (groups and len(fp8_attention_groups(groups)) != len(groups))
        ):
            raise UnsupportedModelError(
                f"{model_dir}: the model is already quantised (quant_method {method or '?'!r}"
                f"{', weight/activation groups ' + str(sorted(groups)) if groups else ''})",
                hint="calibrate from the unquantised (bf16/fp16) checkpoint",
            )
    if not checkpoint.files.files:
        raise UnsupportedModelError(
            f"{model_dir}: no *.safetensors weights",
            hint="convert the checkpoint to safetensors (save_pretrained does this by default)",
        )
    # every shard the index names exists (transformers would stop on the first one missing, with a traceback)
    missing = {}
    for key, name in (checkpoint.files.weight_map or {}).items():
        if not isinstance(name, str) or name not in checkpoint.files.headers:
            missing.setdefault(str(name), []).append(key)
    if missing:
        name, keys = min(missing.items())
        raise CheckpointReadError(
            f"{model_dir / INDEX_FILENAME} names {name}, which is not in {model_dir} "
            f"({len(keys)} tensor(s), e.g. {min(keys)})"
            + (f"; {len(missing) - 1} more file(s) are missing" if len(missing) > 1 else ""),
            hint="copy the missing shard(s) from the original checkpoint; a download may have stopped part way",
        )
    # a FIFO or device among the checkpoint's files would block the tokenizer or loader for ever
    for entry in sorted(model_dir.iterdir()):
        if not (entry.is_dir() or entry.name.startswith(".")):
            require_regular_file(
                entry,
                "checkpoint file",
                error=CheckpointReadError,
                hint="every file of a checkpoint is a regular file; replace it with the real one",
            )
    layers = config.get("num_hidden_layers", schema.text_config(config).get("num_hidden_layers"))
    if isinstance(layers, int) and not isinstance(layers, bool) and layers < 1:
        raise UnsupportedModelError(
            f"{model_dir / 'config.json'}: num_hidden_layers is {layers}",
            hint="a decoder needs at least one layer; restore config.json from the original",
        )
    return PreparedRun(
        checkpoint, None if options.dtype == "auto" else getattr(torch, options.dtype), device
    )


def resolve_target(name: str) -> fp8.Target:
    try:
        return fp8.get_target(name)
    except ValueError as exc:
        raise UnknownTargetError(str(exc), hint="use --target trn2, trn3 or gpu") from None


def effective_dtype(checkpoint: Checkpoint, dtype: torch.dtype | None) -> torch.dtype:
    """`dtype`, else what `from_pretrained(dtype="auto")` picks for this checkpoint."""
    if dtype is not None:
        return dtype
    stored = checkpoint.stored_dtype()
    return getattr(torch, stored) if stored else torch.get_default_dtype()


def resolve_compute(
    requested: str,
    dtype: torch.dtype | None,
    checkpoint: Checkpoint,
    device: torch.device,
    cpu: HostCpu | None = None,
) -> ComputePath:
    """The compute path for the model's effective dtype (`dtype`, else the checkpoint's own) on `cpu` (None: this
    one, `HostCpu.detect`)."""
    try:
        return choose_compute(
            requested, effective_dtype(checkpoint, dtype), device, cpu or HostCpu.detect()
        )
    except ValueError as exc:
        raise UsageError(
            str(exc), hint="--bf16-compute auto picks float32 matmuls on CPUs without native bf16"
        ) from None


def resolve_model_dir(model: str | Path) -> Path:
    """A local checkpoint directory for `model`: the path itself, or a hub snapshot when online."""
    path = Path(model).expanduser()
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        if not path.is_dir():
            raise CheckpointNotFoundError(
                f"model directory not found: {model}",
                hint="pass a local Hugging Face checkpoint directory (config.json + *.safetensors)",
            )
        return path
    try:  # looks like a hub id (org/name) and is not a local path
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.py"]
        return Path(snapshot_download(str(model), allow_patterns=patterns))
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not fetch"
        raise CheckpointNotFoundError(
            f"model {model} is not a local directory and could not be fetched from the hub ({type(exc).__name__})",
            hint="pass a local checkpoint directory, or run where the hub is reachable",
        ) from None


def load_tokenizer(model_dir: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(
            f"{model_dir}: cannot load the tokenizer ({exc})",
            hint="the checkpoint needs its tokenizer files (tokenizer.json, ...)",
        ) from None


def load_model_config(model_dir: Path, trust_remote_code: bool) -> Any:
    """transformers' config of the model, without a quantization config (no loading through a quantizer)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    for attr in ("quantization_config", "compression_config"):
        if hasattr(config, attr):
            delattr(config, attr)
    return config


def faithful_attention(config: dict[str, Any]) -> str | None:
    """eager where transformers' SDPA would drop attention-logit soft-capping (Gemma2), else None."""
    return "eager" if schema.text_config(config).get("attn_logit_softcapping") else None


def load_model(
    model: Checkpoint | Path,
    dtype: torch.dtype | None,
    device: torch.device,
    trust_remote_code: bool,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """The model in `dtype` (None: stored) on `device`, eval mode; MXFP4 experts dequantized as they load."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    checkpoint = model if isinstance(model, Checkpoint) else Checkpoint.open(Path(model))
    model_dir = checkpoint.root
    config = load_model_config(model_dir, trust_remote_code)
    try:
        quantization = {}
        if mxfp4.weights(checkpoint.files.key_files):  # declared, and dequantized as they load
            config.quantization_config = {"quant_method": "mxfp4"}
            quantization = {"quantization_config": Mxfp4Config(dequantize=True)}
        with expert_chunks() if quantization else nullcontext():
            model, info = AutoModelForCausalLM.from_pretrained(
                model_dir,
                config=config,
                dtype=dtype if dtype is not None else "auto",
                output_loading_info=True,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                **quantization,
                ignore_mismatched_sizes=True,
            )  # reported in the loading info (and refused there), not raised
    except (
        ValueError,
        ImportError,
        NotImplementedError,
    ) as exc:  # what transformers raises for a model it cannot run
        raise UnsupportedModelError(
            f"{model_dir}: transformers cannot run this {type(config).__name__.removesuffix('Config')} model "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            hint="upgrade transformers to a version that supports this model family, or calibrate another checkpoint",
        ) from None
    check_loading_info(model_dir, info)
    return model.to(device).eval()


def check_loading_info(model_dir: Path, info: dict[str, Any]) -> None:
    """UnsupportedModelError when the loaded weights do not match the config (transformers fills gaps at random)."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not is_kv_scale_key(k))
    # mismatched: (key, stored shape, model shape)
    mismatched = sorted(m[0] for m in info.get("mismatched_keys") or ())
    problems = [
        f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
        for what, keys in (
            ("missing from the checkpoint", missing),
            ("not in the model", unexpected),
            ("with the wrong shape", mismatched),
        )
        if keys
    ]
    if problems:
        raise UnsupportedModelError(
            f"{model_dir}: the safetensors weights do not match config.json: "
            + "; ".join(problems),
            hint="transformers would fill missing weights with random values; use the config.json and the "
            "*.safetensors files of one and the same model",
        )


def build_skeleton(
    model_dir: Path,
    dtype: torch.dtype,
    trust_remote_code: bool,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """The model with every parameter on the meta device and real buffers (rotary frequencies)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            load_model_config(model_dir, trust_remote_code),
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    return model.requires_grad_(False).eval()


def text_config(model: torch.nn.Module) -> Any:
    """The language model's config (a multimodal model's text_config)."""
    return model.config.get_text_config()


def num_layers(model: torch.nn.Module) -> int:
    return int(text_config(model).num_hidden_layers)


def pad_id(tokenizer: Any) -> int:
    return next(
        (int(c) for c in (tokenizer.pad_token_id, tokenizer.eos_token_id) if c is not None), 0
    )
