"""The "native" engine: the whole model in memory, every batch through the decoder once (hf.attention's cache)."""

from __future__ import annotations

import dataclasses
import time

import torch

from kvcalib.calibration.engine import EngineInputs, Observation
from kvcalib.core.progress import Progress, ProgressCallback
from kvcalib.hf.attention import KVAbsmaxObserver, attention_modules, observe_batch
from kvcalib.hf.compute import compute_path
from kvcalib.hf.data import CalibrationData, batches
from kvcalib.hf.model import faithful_attention, load_model, num_layers
from kvcalib.hf.samples import AttentionSample

__all__ = ["native_engine", "observe_all", "sample_attention"]


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
        layers, queries=inputs.options.attention_scales, sampler=inputs.sampler(layers)
    )
    started = time.perf_counter()
    with compute_path(inputs.compute):
        observe_all(
            hf_model,
            observer,
            inputs.data,
            inputs.options.batch_size,
            inputs.pad_id,
            inputs.device,
            inputs.notify,
        )
    return Observation.of(observer, attn_paths, time.perf_counter() - started, hf_model)


def observe_all(
    model: torch.nn.Module,
    observer: KVAbsmaxObserver,
    data: CalibrationData,
    batch_size: int,
    pad_id: int,
    device: torch.device,
    notify: ProgressCallback,
) -> None:
    """Every right-padded batch through the decoder stack (no LM head), recording K/V absmax."""
    decoder = getattr(model, model.base_model_prefix, model)  # the stack without the LM head
    total_samples, total_tokens = len(data.sequences), data.num_tokens
    done_samples = done_tokens = 0
    notify(Progress("observe", 0, total_samples, 0, total_tokens))
    for input_ids, mask in batches(data.sequences, batch_size, pad_id):
        observe_batch(decoder, observer, input_ids.to(device), mask.to(device))
        done_samples += input_ids.shape[0]
        done_tokens += int(mask.sum())
        notify(Progress("observe", done_samples, total_samples, done_tokens, total_tokens))


def sample_attention(inputs: EngineInputs) -> tuple[tuple[AttentionSample, ...], ...]:
    """The scale objective's samples alone (for llm-compressor's oneshot): the sampled sequences, run again."""
    data = dataclasses.replace(
        inputs.data,
        sequences=tuple(s for s in inputs.data.sequences if s in inputs.sample_sequences),
    )
    options = dataclasses.replace(inputs.options, attention_scales=False)
    return native_engine(
        dataclasses.replace(inputs, data=data, options=options, notify=lambda progress: None)
    ).samples
