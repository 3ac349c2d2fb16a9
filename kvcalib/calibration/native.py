"""The "native" engine: the whole model in memory, every batch through the decoder once (hf.attention's cache)."""

from __future__ import annotations

import dataclasses
import time

from kvcalib.calibration.engine import EngineInputs, Observation
from kvcalib.core.progress import Progress
from kvcalib.hf.attention import KVAbsmaxObserver, attention_modules, observe_batch
from kvcalib.hf.compute import compute_path
from kvcalib.hf.data import batches
from kvcalib.hf.model import faithful_attention, load_model, num_layers
from kvcalib.hf.samples import AttentionSample

__all__ = ["native_engine", "sample_attention"]


def native_engine(inputs: EngineInputs) -> Observation:
    inputs.notify(Progress("load-model"))
    hf_model = load_model(
        inputs.checkpoint,
        inputs.dtype,
        inputs.device,
        inputs.options.trust_remote_code,
        attn_implementation=faithful_attention(inputs.checkpoint.config),
    )
    layers = num_layers(hf_model)
    attn_paths = attention_modules(hf_model, layers, inputs.checkpoint.root)
    observer = KVAbsmaxObserver(
        layers, queries=inputs.attention_scales, sampler=inputs.sampler(layers)
    )
    decoder = getattr(
        hf_model, hf_model.base_model_prefix, hf_model
    )  # the stack without the LM head
    data, done_samples, done_tokens = inputs.data, 0, 0
    inputs.notify(Progress("observe", 0, len(data.sequences), 0, data.num_tokens))
    started = time.perf_counter()
    with compute_path(
        inputs.compute
    ):  # every right-padded batch through the decoder stack, K/V absmax recorded
        for input_ids, mask in batches(data.sequences, inputs.options.batch_size, inputs.pad_id):
            observe_batch(decoder, observer, input_ids.to(inputs.device), mask.to(inputs.device))
            done_samples, done_tokens = (
                done_samples + input_ids.shape[0],
                done_tokens + int(mask.sum()),
            )
            inputs.notify(
                Progress("observe", done_samples, len(data.sequences), done_tokens, data.num_tokens)
            )
    return Observation.of(observer, attn_paths, time.perf_counter() - started, hf_model)


def sample_attention(inputs: EngineInputs) -> tuple[tuple[AttentionSample, ...], ...]:
    """The scale objective's samples alone (for llm-compressor's oneshot): the sampled sequences, run again."""
    data = dataclasses.replace(
        inputs.data,
        sequences=tuple(s for s in inputs.data.sequences if s in inputs.sample_sequences),
    )
    return native_engine(
        dataclasses.replace(inputs, data=data, attention_scales=False, notify=lambda progress: None)
    ).samples
