"""calibrate: per-layer K/V absmax over a dataset -> FP8 scales -> a new checkpoint.

Cheap checks first (target, model config, output path, dataset), then the model is loaded
and every calibration token runs through the decoder stack once (no LM head, nothing after
the last layer's K/V). The scales `absmax / fp8_max(target)` go into a new checkpoint
written atomically, which is validated before it is put in place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import __version__, fp8
from .checkpoint import WritePlan, check_output_path, read_config, scan_checkpoint, write_checkpoint
from .cpu import ComputePath, HostCpu, choose_compute, compute_path
from .data import CalibrationData, batches, load_calibration_data
from .distributed import Ranks, observe_across_ranks, rank_device
from .errors import (
    CalibrationError,
    CheckpointNotFoundError,
    UnknownTargetError,
    UnsupportedModelError,
    UsageError,
    ValidationFailedError,
)
from .memory import choose_engine, out_of_memory_error
from .observe import KVAbsmaxObserver, attention_modules, observe_batch, register_attention
from .recipe import plan_recipe
from .schema import SCALES_FILENAME, kv_only_quantization_config, scale_key

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Progress:
    """What the library tells its caller while it works (the CLI draws a progress bar)."""

    stage: str  # "load-data" | "load-model" | "observe" | "write"
    samples_done: int = 0
    samples_total: int = 0
    tokens_done: int = 0
    tokens_total: int = 0
    layer: int = 0  # the stream engine: the layer being observed, of num_layers
    num_layers: int = 0


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class LayerScales:
    layer: int
    k_absmax: float
    v_absmax: float
    k_scale: float
    v_scale: float
    k_key: str
    v_key: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CalibrationResult:
    output: str
    model: str
    target: str
    fp8_max: float
    num_samples: int
    num_tokens: int
    layers: tuple[LayerScales, ...]
    seconds: float
    observe_seconds: float
    warnings: tuple[str, ...] = ()
    validation: dict[str, Any] | None = None
    compute: str = ""  # the compute path (kvcalib.cpu.ComputePath.describe())

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.observe_seconds if self.observe_seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "model": self.model,
            "target": self.target,
            "fp8_max": self.fp8_max,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "compute": self.compute,
            "layers": [layer.to_dict() for layer in self.layers],
            "warnings": list(self.warnings),
            "validation": self.validation,
        }


@dataclass(frozen=True)
class CalibrateOptions:
    target: str | None = None  # None: the recipe's kvcalib.target, else fp8.DEFAULT_TARGET
    split: str = "train"
    text_column: str | None = None
    num_samples: int = 512
    max_seq_len: int = 2048
    batch_size: int = 4
    seed: int = 42
    dtype: str = "auto"
    device: str = "cpu"
    overwrite: bool = False
    trust_remote_code: bool = False
    engine: str = "auto"  # "auto": "stream" when the weights would not fit in memory, else "native"
    recipe: str | None = None  # an llm-compressor recipe whose kv_cache_scheme to use (kvcalib.recipe)
    bf16_compute: str = "auto"  # auto | native | float32 (kvcalib.cpu: bf16 matmuls in float32 where bf16 is slow)
    cpu: HostCpu | None = None  # the host CPU (the CLI reads it); None: assumed to have native bf16
    extra_provenance: dict[str, Any] = field(default_factory=dict)
    ranks: Ranks | None = None  # set under torchrun: this process's share; only rank 0 writes


@dataclass(frozen=True)
class EngineInputs:
    """What an observation engine gets: everything checked and loaded except the weights."""

    model_dir: Path
    config: dict[str, Any]
    data: CalibrationData
    options: CalibrateOptions
    dtype: torch.dtype | None  # None: the checkpoint's own dtype
    device: torch.device
    pad_id: int
    notify: ProgressCallback
    compute: ComputePath = ComputePath("native", "not chosen")


@dataclass(frozen=True)
class Observation:
    """What an engine measured: per-layer absmax of K and V over every calibration token."""

    k_absmax: torch.Tensor  # [num_layers] float32, on the CPU
    v_absmax: torch.Tensor  # [num_layers] float32, on the CPU
    observed: tuple[int, ...]  # forward passes that reached each layer (0: never observed)
    attention_paths: dict[int, str]  # layer -> state-dict path of its attention module
    seconds: float  # time spent observing (for tokens/s)


Engine = Callable[[EngineInputs], Observation]

# Engines by name, as "module:function" so that optional ones import only when chosen.
ENGINES: dict[str, str] = {
    "native": "kvcalib.calibrate:native_engine",
    "stream": "kvcalib.stream:stream_engine",
    "llmcompressor": "kvcalib.llmcompressor_engine:llmcompressor_engine",
}


def _resolve_engine(name: str) -> Engine:
    import importlib

    if name not in ENGINES:
        raise UsageError(f"unknown engine {name!r}", hint=f"use one of {', '.join(sorted(ENGINES))}")
    module, function = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), function)


def native_engine(inputs: EngineInputs) -> Observation:
    """The whole model in memory; every batch through the decoder stack with the observing attention."""
    inputs.notify(Progress("load-model"))
    hf_model = _load_model(inputs.model_dir, inputs.dtype, inputs.device, inputs.options.trust_remote_code)
    num_layers = _num_layers(hf_model)
    attn_paths = attention_modules(hf_model, num_layers, inputs.model_dir)
    observer = KVAbsmaxObserver(num_layers, device=inputs.device)
    started = time.perf_counter()
    with compute_path(inputs.compute):
        _observe(hf_model, observer, inputs.data, inputs.options.batch_size, inputs.pad_id, inputs.device,
                 inputs.notify)
    return Observation(
        k_absmax=observer.k_absmax.cpu(), v_absmax=observer.v_absmax.cpu(), observed=tuple(observer.observed),
        attention_paths=attn_paths, seconds=time.perf_counter() - started,
    )


def calibrate(model: str | Path, dataset: str, output: str | Path, options: CalibrateOptions | None = None,
              progress: ProgressCallback | None = None) -> CalibrationResult:
    """Calibrate `model` on `dataset` and write the FP8-KV checkpoint to `output`."""
    opts = options or CalibrateOptions()
    notify = progress or (lambda _p: None)
    started = time.perf_counter()

    # --- cheap checks, before any weight is loaded ------------------------------------
    plan = plan_recipe(opts.recipe, opts.target, opts.engine)  # --recipe, --target, --engine checked together
    target = _resolve_target(plan.target)
    opts = replace(opts, extra_provenance={**plan.provenance, **opts.extra_provenance})
    if opts.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, not {opts.batch_size}")
    torch_dtype = _resolve_dtype(opts.dtype)
    device = _resolve_device(opts.device)
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    check_supported_model(model_dir, config, opts.trust_remote_code)
    output = Path(output)
    check_output_path(output, model_dir, opts.overwrite)
    device = rank_device(device, opts.ranks)
    local_copies = opts.ranks.local_world_size if opts.ranks else 1
    choice = choose_engine(opts.engine, model_dir, torch_dtype, device, copies=local_copies)
    opts = replace(opts, engine=choice.engine)
    compute = resolve_compute(opts.bf16_compute, torch_dtype, model_dir, config, device, opts.cpu)
    if opts.engine == "llmcompressor":  # its oneshot runs the model as its users run it
        compute = ComputePath("native", "llm-compressor's oneshot runs the model natively")

    notify(Progress("load-data"))
    tokenizer = _load_tokenizer(model_dir, opts.trust_remote_code)
    data = load_calibration_data(
        dataset, tokenizer, split=opts.split, text_column=opts.text_column,
        num_samples=opts.num_samples, max_seq_len=opts.max_seq_len, seed=opts.seed,
    )

    # --- observe ---------------------------------------------------------------------
    engine = _resolve_engine(opts.engine)
    inputs = EngineInputs(model_dir, config, data, opts, torch_dtype, device, _pad_id(tokenizer), notify, compute)
    try:
        if opts.ranks is not None and opts.ranks.world_size > 1:
            observation = observe_across_ranks(engine, inputs, opts.ranks)
        else:
            observation = engine(inputs)
    except (MemoryError, RuntimeError) as exc:
        raise out_of_memory_error(exc, opts.engine, device) or exc
    observe_seconds = observation.seconds

    # --- scales, checkpoint ------------------------------------------------------------
    layers, warnings = _layer_scales(observation, target, model_dir)
    dtype_name = str(torch_dtype).removeprefix("torch.") if torch_dtype else str(config.get("dtype") or config.get("torch_dtype"))
    provenance = _provenance(model_dir, data, opts, target, layers, dtype_name)
    provenance["compute"] = compute.describe()
    scales = {}
    for layer in layers:
        scales[layer.k_key] = torch.tensor([layer.k_scale], dtype=torch.float32)
        scales[layer.v_key] = torch.tensor([layer.v_scale], dtype=torch.float32)

    if choice.reason:
        warnings.append(choice.reason)
    if opts.ranks is not None and not opts.ranks.is_writer:  # rank 0 writes and validates
        return CalibrationResult(
            output=str(output), model=str(model), target=target.name, fp8_max=target.fp8_max,
            num_samples=len(data.sequences), num_tokens=data.num_tokens, layers=tuple(layers),
            seconds=time.perf_counter() - started, observe_seconds=observe_seconds,
            warnings=tuple(warnings) + (f"rank {opts.ranks.rank}: nothing written (rank 0 writes)",),
            compute=compute.describe(),
        )

    notify(Progress("write"))
    validation: dict[str, Any] = {}

    def check(tmp_dir: Path) -> None:
        from .validate import validate_checkpoint

        report = validate_checkpoint(tmp_dir, target.name)
        validation.update(report.to_dict())
        validation["checkpoint"] = str(output)
        if not report.ok:
            first = report.errors[0]
            raise ValidationFailedError(
                f"the checkpoint kvcalib wrote fails validation ({len(report.errors)} error(s)); "
                f"first: [{first.rule}] {first.message}",
                hint="nothing was written; please report this as a kvcalib bug",
                report=report,
            )

    notes = write_checkpoint(
        model_dir, output,
        WritePlan(scales=scales, quantization_config=kv_only_quantization_config(), provenance=provenance),
        overwrite=opts.overwrite, check=check,
    )
    return CalibrationResult(
        output=str(output), model=str(model), target=target.name, fp8_max=target.fp8_max,
        num_samples=len(data.sequences), num_tokens=data.num_tokens, layers=tuple(layers),
        seconds=time.perf_counter() - started, observe_seconds=observe_seconds,
        warnings=tuple(list(plan.warnings) + warnings + notes), validation=validation or None,
        compute=compute.describe(),
    )


def _resolve_target(name: str) -> fp8.Target:
    try:
        return fp8.get_target(name)
    except ValueError as exc:
        raise UnknownTargetError(str(exc), hint="use --target trn2, trn3 or gpu") from None


def _resolve_dtype(name: str) -> torch.dtype | None:
    if name == "auto":
        return None
    if name not in DTYPES:
        raise UsageError(f"unknown --dtype {name!r}", hint=f"use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_compute(requested: str, dtype: torch.dtype | None, model_dir: Path, config: dict[str, Any],
                    device: torch.device, cpu: HostCpu | None) -> ComputePath:
    """The compute path for the model's effective dtype (`dtype`, else the checkpoint's own)."""
    from .stream import checkpoint_dtype

    try:
        effective = dtype or checkpoint_dtype(config, scan_checkpoint(model_dir))
        return choose_compute(requested, effective, device, cpu)
    except ValueError as exc:
        raise UsageError(str(exc), hint="--bf16-compute auto picks float32 matmuls on CPUs without native bf16") from None


def _resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown --device {name!r}", hint="use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but torch sees no CUDA device", hint="use --device cpu")
    return device


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

        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.py"]))
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not fetch"
        raise CheckpointNotFoundError(
            f"model {model} is not a local directory and could not be fetched from the hub ({type(exc).__name__})",
            hint="pass a local checkpoint directory, or run where the hub is reachable",
        ) from None


def check_supported_model(model_dir: Path, config: dict[str, Any], trust_remote_code: bool) -> None:
    """A causal LM, unquantised (or KV-only), with safetensors weights."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    remote = trust_remote_code and "AutoModelForCausalLM" in (config.get("auto_map") or {})
    if architectures:
        causal = any(isinstance(a, str) and (a in causal_classes or a.endswith("ForCausalLM")) for a in architectures)
    else:
        causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not (causal or remote):
        raise UnsupportedModelError(
            f"{model_dir}: model_type {model_type!r} (architectures {config.get('architectures')}) is not a causal "
            "language model transformers can load with AutoModelForCausalLM",
            hint="kvcalib calibrates decoder-only LLMs (Llama, Qwen3, Mistral, ...)",
        )
    qcfg = config.get("quantization_config") or config.get("compression_config")
    if qcfg:
        method = str(qcfg.get("quant_method", "")).lower().replace("_", "-") if isinstance(qcfg, dict) else ""
        groups = qcfg.get("config_groups") if isinstance(qcfg, dict) else None
        if method != "compressed-tensors" or groups:
            raise UnsupportedModelError(
                f"{model_dir}: the model is already quantised (quant_method {method or '?'!r}"
                f"{', weight/activation groups ' + str(sorted(groups)) if groups else ''})",
                hint="calibrate from the unquantised (bf16/fp16) checkpoint",
            )
    if not any(model_dir.glob("*.safetensors")):
        raise UnsupportedModelError(
            f"{model_dir}: no *.safetensors weights",
            hint="convert the checkpoint to safetensors (save_pretrained does this by default)",
        )


def _load_tokenizer(model_dir: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{model_dir}: cannot load the tokenizer ({exc})",
                                    hint="the checkpoint needs its tokenizer files (tokenizer.json, ...)") from None


def _load_model(model_dir: Path, dtype: torch.dtype | None, device: torch.device,
                trust_remote_code: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    # An earlier KV-only calibration must not make transformers load through a quantizer.
    for attr in ("quantization_config", "compression_config"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=dtype if dtype is not None else "auto",
        attn_implementation=register_attention(), trust_remote_code=trust_remote_code,
    )
    return model.to(device).eval()


def _num_layers(model: torch.nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def _pad_id(tokenizer: Any) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _observe(model: torch.nn.Module, observer: KVAbsmaxObserver, data: CalibrationData, batch_size: int,
             pad_id: int, device: torch.device, notify: ProgressCallback) -> None:
    decoder = getattr(model, model.base_model_prefix, model)  # the stack without the LM head
    total_samples, total_tokens = len(data.sequences), data.num_tokens
    done_samples = done_tokens = 0
    notify(Progress("observe", 0, total_samples, 0, total_tokens))
    for input_ids, mask in batches(data.sequences, batch_size, pad_id):
        observe_batch(decoder, observer, input_ids.to(device), mask.to(device))
        done_samples += input_ids.shape[0]
        done_tokens += int(mask.sum())
        notify(Progress("observe", done_samples, total_samples, done_tokens, total_tokens))


def _layer_scales(observation: Observation, target: fp8.Target, model_dir: Path) -> tuple[list[LayerScales], list[str]]:
    unobserved = [i for i, n in enumerate(observation.observed) if n == 0]
    if unobserved:
        raise CalibrationError(
            f"{model_dir}: decoder layer(s) {unobserved} were never observed during calibration",
            hint="the model's attention does not go through transformers' attention interface for these layers",
        )
    k_absmax = observation.k_absmax.float().cpu()
    v_absmax = observation.v_absmax.float().cpu()
    warnings: list[str] = []
    for kind, values in (("K", k_absmax), ("V", v_absmax)):
        for i, value in enumerate(values.tolist()):
            if not math.isfinite(value):
                raise CalibrationError(
                    f"layer {i}: {kind} absmax is {value} (overflow in the calibration dtype)",
                    hint="calibrate with --dtype bfloat16 or --dtype float32",
                )
            if value == 0.0:
                warnings.append(f"layer {i}: {kind} was exactly zero on every token; its scale is floored at {fp8.SCALE_FLOOR}")
    k_scales = fp8.scale_from_absmax(k_absmax, target).tolist()
    v_scales = fp8.scale_from_absmax(v_absmax, target).tolist()
    layers = [
        LayerScales(
            layer=i, k_absmax=float(k_absmax[i]), v_absmax=float(v_absmax[i]),
            k_scale=k_scales[i], v_scale=v_scales[i],
            k_key=scale_key(observation.attention_paths[i], "k"), v_key=scale_key(observation.attention_paths[i], "v"),
        )
        for i in range(len(observation.observed))
    ]
    return layers, warnings


def _provenance(model_dir: Path, data: CalibrationData, opts: CalibrateOptions, target: fp8.Target,
                layers: list[LayerScales], dtype_name: str) -> dict[str, Any]:
    return {
        "tool": "kvcalib",
        "kvcalib_version": __version__,
        "scale_convention": "x = fp8 * scale; scale = absmax / fp8_max (rounded up so the chip never saturates absmax)",
        "target": target.name,
        "fp8_max": target.fp8_max,
        "scales_file": SCALES_FILENAME,
        "model": str(model_dir),
        "dtype": dtype_name,
        "engine": opts.engine,
        "dataset": data.source,
        "split": data.split,
        "column": data.column,
        "seed": opts.seed,
        "max_seq_len": opts.max_seq_len,
        "num_samples": len(data.sequences),
        "num_rows_selected": data.rows_selected,
        "num_rows_empty": data.rows_empty,
        "num_tokens": data.num_tokens,
        "observer": "static_minmax",
        "layers": [
            {"layer": l.layer, "k_absmax": l.k_absmax, "v_absmax": l.v_absmax, "k_scale": l.k_scale, "v_scale": l.v_scale}
            for l in layers
        ],
        **opts.extra_provenance,
    }
