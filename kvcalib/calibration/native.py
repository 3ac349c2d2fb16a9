"""The "native" engine: the whole model in memory, every batch through the decoder once (hf.attention's cache)."""

from __future__ import annotations

import dataclasses

from kvcalib.calibration.engine import EngineInputs, Observation
from kvcalib.core.progress import Progress
from kvcalib.hf.attention import KVAbsmaxObserver, observed_forward
from kvcalib.hf.data import batches
from kvcalib.hf.model import faithful_attention, load_model
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
    data = inputs.data
    inputs.notify(Progress("observe", 0, len(data.sequences), 0, data.num_tokens))

    def run(
        observer: KVAbsmaxObserver,
    ) -> None:  # every right-padded batch through the decoder stack
        done = (0, 0)
        for ids, mask in batches(data.sequences, inputs.options.batch_size, inputs.pad_id):
            ids, mask = ids.to(inputs.device), mask.to(inputs.device)
            with observer.batch(ids, mask):
                observed_forward(decoder, ids, mask, observer.observe)
            done = (done[0] + ids.shape[0], done[1] + int(mask.sum()))
            inputs.notify(
                Progress("observe", done[0], len(data.sequences), done[1], data.num_tokens)
            )

    # the stack without the LM head
    decoder = getattr(hf_model, hf_model.base_model_prefix, hf_model)
    return inputs.observe(hf_model, decoder, run)


def sample_attention(inputs: EngineInputs) -> tuple[tuple[AttentionSample, ...], ...]:
    """The scale objective's samples alone (for llm-compressor's oneshot): the sampled sequences, run again."""
    data = dataclasses.replace(
        inputs.data,
        sequences=tuple(s for s in inputs.data.sequences if s in inputs.sample_sequences),
    )
    return native_engine(
        dataclasses.replace(inputs, data=data, attention_scales=False, notify=lambda progress: None)
    ).samples
