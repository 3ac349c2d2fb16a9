"""`--engine llmcompressor` (`pip install kvcalib[llmcompressor]`): llm-compressor's oneshot observes K/V.

oneshot runs a KV-only `QuantizationModifier` (the recipe's kv_cache_scheme) on kvcalib's sequences, one per batch;
its `k_scale`/`v_scale`, sized for compressed-tensors' FP8 max (448), are turned back into absmax for calibrate."""

from __future__ import annotations

import functools
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
    calls, samples, tokens = [0] * n_layers, len(sequences), inputs.data.num_tokens

    def count(
        layer: int, *_: Any
    ) -> None:  # each sequence reaches a layer twice: calibrate, propagate
        calls[layer] += 1
        done = (layer + min(calls[layer] / (2 * samples), 1.0)) / n_layers
        inputs.notify(
            Progress("observe", round(done * samples), samples, round(done * tokens), tokens)
        )

    handles = [
        model.get_submodule(path).register_forward_pre_hook(functools.partial(count, i))
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
    return Observation(tuple(absmax["k"]), tuple(absmax["v"]), tuple(calls), attn_paths, seconds)
