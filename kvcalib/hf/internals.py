"""The door to transformers' private internals: every one kvcalib uses is fetched here, by name, with the parameters
kvcalib passes it checked. Each was checked against the releases in TESTED (every minor release from 5.17 to 5.25;
CI runs the oldest and the newest). Where an internal is missing or its parameters changed, the command refuses
with one line naming the installed release, the tested range and what to install: kvcalib never observes K/V or
loads weights through a function that may now do something else. Where a public path gives the same result, it is
taken instead (`cache_kwargs`).

What kvcalib uses, and what for:
- `core_model_loading.rename_source_key`, `.WeightConverter`, `.convert_and_load_state_dict_in_model`,
  `conversion_mapping.get_model_conversion_mapping`, `modeling_utils.LoadStateDictConfig`: --stream-layers loads one
  module's weights at a time, renamed, fused and converted as `from_pretrained` would (calibration/stream.py).
- `eager_attention_forward` in a model's modeling file: what its attention modules call when loaded with eager,
  which the attention function kvcalib switches in runs (hf/attention.py `observing_attention`).
- `models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: which architectures are causal LMs (hf/model.py).
- `integrations.mxfp4.convert_moe_packed_tensors` and `._convert_moe_packed_tensors`,
  `quantizers.auto.AutoHfQuantizer`: MXFP4 experts dequantised as they load, by kvcalib's table (hf/mxfp4.py)."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

from kvcalib.core.errors import MissingDependencyError, UnsupportedModelError

__all__ = [
    "TESTED",
    "cache_kwargs",
    "causal_lm_names",
    "conversion_mapping",
    "eager_attention",
    "internal",
    "load_state_dict",
    "mxfp4_dequantizing",
    "mxfp4_quantizer",
    "mxfp4_table",
    "renamer",
]

# CI runs 5.17.0 and 5.25.0; scripts/stack_table.py each minor release between
TESTED = ("5.17", "5.25")
INSTALL = "pip install 'transformers>=5.17,<5.26'"


def internal(module: str, name: str, *params: str) -> Any:
    """`transformers.<module>.<name>` (`module` absolute where it starts with transformers: remote code's
    transformers_modules), which must take `params`; a one-line refusal where it is missing or changed."""
    import transformers

    module = module if module.startswith("transformers") else f"transformers.{module}"
    where = f"{module}.{name}"
    try:
        found = attrgetter(name)(importlib.import_module(module))
    except (ImportError, AttributeError):
        found, changed = None, "is missing"
    else:
        taken = inspect.signature(found).parameters if params else {}
        absent = [p for p in params if p not in taken]
        changed = f"no longer takes {', '.join(absent)}" if absent else ""
    if changed:  # one line: the release, what changed, the tested range, what to install
        raise MissingDependencyError(
            f"transformers {transformers.__version__}: {where}, which kvcalib uses, {changed} (kvcalib is tested "
            f"with transformers {TESTED[0]} to {TESTED[1]}): {INSTALL}"
        )
    return found


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands `model` a KV cache: `cache` where its forward takes it (transformers 5.25's models,
    where `past_key_values` is deprecated), else `past_key_values` (before, and remote code). generate() takes the
    same name as the release's models (its model kwargs reach forward)."""
    parameters = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in parameters else "past_key_values": cache}


def conversion_mapping(model: Any, quantizer: Any) -> list[Any]:
    """from_pretrained's weight renamings and conversions for `model` (MXFP4 dequantisation with `quantizer`)."""
    mapping = internal(
        "conversion_mapping", "get_model_conversion_mapping", "model", "hf_quantizer"
    )
    return mapping(model, hf_quantizer=quantizer)


def renamer(model: Any, quantizer: Any, meta: dict[str, Any]) -> Callable[[str], str]:
    """checkpoint key -> the model parameter it loads into, as from_pretrained renames it (`meta`: the model's
    state dict; `quantizer`: MXFP4's conversions), the internals looked up once for every key."""
    rename = internal(
        "core_model_loading",
        "rename_source_key",
        "source_key",
        "weight_renamings",
        "weight_converters",
        "base_model_prefix",
        "meta_state_dict",
    )
    converter = internal("core_model_loading", "WeightConverter")
    mapping = conversion_mapping(model, quantizer)
    renamings = [t for t in mapping if not isinstance(t, converter)]
    converters = [t for t in mapping if isinstance(t, converter)]
    return lambda key: rename(
        source_key=key,
        weight_renamings=renamings,
        weight_converters=converters,
        base_model_prefix=model.base_model_prefix,
        meta_state_dict=meta,
    )[0]


def load_state_dict(
    model: Any, state: dict[str, Any], dtype: Any, mapping: list[Any], quantizer: Any
) -> None:
    """Load checkpoint tensors `state` into `model` in `dtype` as from_pretrained does, through `mapping`
    (`conversion_mapping`'s) and `quantizer` (None: the tensors as stored). transformers records a conversion
    that raised and goes on: the first is raised here."""
    config = internal(
        "modeling_utils", "LoadStateDictConfig", "weight_mapping", "dtype", "hf_quantizer"
    )
    load = internal(
        "core_model_loading",
        "convert_and_load_state_dict_in_model",
        "model",
        "state_dict",
        "load_config",
    )
    info, _ = load(
        model=model,
        state_dict=state,
        load_config=config(
            weight_mapping=mapping,
            dtype=dtype,
            hf_quantizer=quantizer,
        ),
    )
    for weight, error in (getattr(info, "conversion_errors", None) or {}).items():
        # the exception the traceback ends with
        raised = re.findall(r"^\w+(?:Error|Exception): .*$", error, re.MULTILINE)
        raise UnsupportedModelError(
            f"transformers could not convert the checkpoint's tensors for {weight}: "
            f"{(raised or error.strip().splitlines())[-1]}",
            hint="calibrate this checkpoint in memory (without --stream-layers) for transformers' own report",
        )


def eager_attention(attention: type) -> Callable[..., Any]:
    """The eager attention function of the modeling file that defines the attention module class `attention`."""
    return internal(
        attention.__module__,
        "eager_attention_forward",
        "module",
        "query",
        "key",
        "value",
        "attention_mask",
    )


def causal_lm_names() -> dict[str, str]:
    """model_type -> the causal-LM class transformers maps it to."""
    from transformers import AutoModelForCausalLM

    # from the lazy AutoModelForCausalLM's own module: importing transformers.models.auto directly would run
    # transformers/models/__init__.py, a scan of every model's directory
    return internal(
        AutoModelForCausalLM.__module__.removeprefix("transformers."),
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    )


def mxfp4_quantizer() -> Any:
    """transformers' MXFP4 quantizer, set to dequantize the experts as they load."""
    from transformers import Mxfp4Config

    quantizer = internal("quantizers.auto", "AutoHfQuantizer")
    return quantizer.from_config(Mxfp4Config(dequantize=True), pre_quantized=True)


def mxfp4_table(dtype: Any) -> Any:
    """transformers' own MXFP4 values of every byte (two codes) under every scale: [512, 256], byte b's two values
    at rows 2b and 2b + 1, column the stored exponent."""
    import torch

    convert = internal("integrations.mxfp4", "_convert_moe_packed_tensors", "dtype")
    byte = torch.arange(256, dtype=torch.uint8)
    return convert(
        byte.expand(256, 256).reshape(1, 256, 1, 256), byte.reshape(1, 256, 1), dtype=dtype
    )[0]


@contextmanager
def mxfp4_dequantizing(replacement: Callable[..., Any]) -> Iterator[None]:
    """While inside, transformers' MXFP4 dequantisation (`convert_moe_packed_tensors(blocks, scales, dtype=)`, what
    its loader calls) is `replacement`. `mxfp4_table`'s internal is checked here, on entry: inside a load,
    transformers records what a conversion raises instead of raising it."""
    internal("integrations.mxfp4", "_convert_moe_packed_tensors", "dtype")
    original = internal("integrations.mxfp4", "convert_moe_packed_tensors", "dtype")
    module = importlib.import_module("transformers.integrations.mxfp4")
    module.convert_moe_packed_tensors = replacement
    try:
        yield
    finally:
        module.convert_moe_packed_tensors = original
