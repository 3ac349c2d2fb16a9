"""`--engine llmcompressor` (`pip install kvcalib[llmcompressor]`): llm-compressor's oneshot observes K/V.

oneshot runs a KV-only `QuantizationModifier` (the recipe's kv_cache_scheme) on kvcalib's sequences, one per batch;
its `k_scale`/`v_scale`, sized for compressed-tensors' FP8 max (448), are turned back into absmax for calibrate."""

from __future__ import annotations

import time
from typing import Any

import torch

from kvcalib.calibration.engine import EngineInputs, Observation
from kvcalib.calibration.recipe import load_recipe, require_llmcompressor
from kvcalib.core.errors import CalibrationError
from kvcalib.core.progress import Progress
from kvcalib.core.schema import ATTN_HEAD, kv_cache_scheme_args, parse_kv_scheme
from kvcalib.hf.attention import attention_modules
from kvcalib.hf.model import load_model, num_layers

__all__ = ["llmcompressor_engine"]


def llmcompressor_engine(inputs: EngineInputs) -> Observation:
    require_llmcompressor()
    from compressed_tensors.quantization.utils import calculate_range
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    opts = inputs.options
    scheme = (
        parse_kv_scheme(load_recipe(opts.recipe).scheme)
        if opts.recipe
        else kv_cache_scheme_args(opts.strategy or "tensor")
    )
    inputs.notify(Progress("load-model"))
    # As llm-compressor users load it: AutoModelForCausalLM with the default attention.
    model = load_model(inputs.checkpoint, inputs.dtype, inputs.device, opts.trust_remote_code)
    n_layers = num_layers(model)
    attn_paths = attention_modules(model, n_layers, inputs.checkpoint.root)

    sequences = inputs.data.sequences
    dataset = Dataset.from_dict(
        {
            "input_ids": [list(s) for s in sequences],
            "attention_mask": [[1] * len(s) for s in sequences],
        }
    )
    calls = [0] * n_layers
    handles = [
        model.get_submodule(path).register_forward_pre_hook(_counter(calls, i, inputs, n_layers))
        for i, path in attn_paths.items()
        if i < n_layers
    ]
    started = time.perf_counter()
    try:
        oneshot(
            model=model,
            recipe=QuantizationModifier(kv_cache_scheme=scheme),
            dataset=dataset,
            batch_size=1,
            num_calibration_samples=len(sequences),
            shuffle_calibration_samples=False,
            max_seq_length=opts.max_seq_len,
            trust_remote_code_model=opts.trust_remote_code,
        )
    finally:
        for handle in handles:
            handle.remove()
    seconds = time.perf_counter() - started

    _, sized_for = calculate_range(scheme, "cpu")  # the FP8 max llm-compressor divided by
    absmax: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
    per_head = scheme.strategy == ATTN_HEAD  # a str enum
    for i in range(n_layers):
        module = model.get_submodule(attn_paths[i])
        for kind in ("k", "v"):
            scale = getattr(module, f"{kind}_scale", None)
            if not isinstance(scale, torch.Tensor) or (scale.numel() != 1 and not per_head):
                raise CalibrationError(
                    f"layer {i}: llm-compressor left no {'per-head' if per_head else 'per-tensor'} {kind}_scale on "
                    f"{attn_paths[i]} ({'none' if scale is None else tuple(scale.shape)})",
                    hint="the engine needs a static kv_cache_scheme; see the shipped recipe (--recipe trn2)",
                )
            # llm-compressor's per-head scales are [kv_heads, 1, 1]
            absmax[kind].append(scale.detach().float().cpu().reshape(-1) * sized_for.float().cpu())
    return Observation(
        k_heads=tuple(absmax["k"]),
        v_heads=tuple(absmax["v"]),
        observed=tuple(calls),
        attention_paths=attn_paths,
        seconds=seconds,
    )


def _counter(calls: list[int], layer: int, inputs: EngineInputs, num_layers: int) -> Any:
    """A pre-hook counting the attention module's calls (each sequence twice a layer: calibrate, propagate)."""
    total_samples, total_tokens = len(inputs.data.sequences), inputs.data.num_tokens
    per_layer = 2 * total_samples

    def hook(_module: torch.nn.Module, _args: Any) -> None:
        calls[layer] += 1
        done = min(
            1.0, (layer * per_layer + min(calls[layer], per_layer)) / (num_layers * per_layer)
        )
        inputs.notify(
            Progress(
                "observe",
                round(done * total_samples),
                total_samples,
                round(done * total_tokens),
                total_tokens,
            )
        )

    return hook
