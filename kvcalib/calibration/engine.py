"""The engine contract: what an observation engine gets (EngineInputs) and returns (Observation)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcalib.calibration.options import CalibrateOptions, Machine
from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.cpu import ComputePath
from kvcalib.core.progress import ProgressCallback
from kvcalib.hf.attention import KVAbsmaxObserver, attention_modules, observing_attention
from kvcalib.hf.compute import compute_path
from kvcalib.hf.data import CalibrationData
from kvcalib.hf.memory import MemoryLimit
from kvcalib.hf.model import num_layers
from kvcalib.hf.samples import AttentionSample, AttentionSampler

__all__ = ["Engine", "EngineInputs", "Observation"]


@dataclass(frozen=True)
class EngineInputs:
    """What an observation engine gets: everything checked and loaded except the weights."""

    checkpoint: Checkpoint  # config.json and the safetensors headers, read once
    data: CalibrationData
    options: CalibrateOptions  # as the user gave them
    machine: Machine
    attention_scales: bool  # observe Q too: asked, or the recipe's
    dtype: torch.dtype | None  # None: the checkpoint's own dtype
    device: torch.device
    pad_id: int
    notify: ProgressCallback
    compute: ComputePath
    memory: MemoryLimit  # this host's memory limit (the stream engine sizes its spill by it)
    sample_sequences: frozenset[tuple[int, ...]] = (
        frozenset()
    )  # the scale objective's sequences (none: absmax)
    probe_layers: int | None = (
        None  # calibrate --plan's timed probe: the stream engine stops after this many layers
    )

    def observe(
        self, model: torch.nn.Module, decoder: torch.nn.Module, run: Callable[[Any], None]
    ) -> Observation:
        """`run(observer)` with `decoder`'s attention observed (K/V, Q if asked, the scale objective's samples)."""
        n = num_layers(model)
        paths = attention_modules(model, n, self.checkpoint.root)
        sampler = AttentionSampler(n, self.sample_sequences) if self.sample_sequences else None
        observer = KVAbsmaxObserver(n, queries=self.attention_scales, sampler=sampler)
        started = time.perf_counter()
        with (
            torch.inference_mode(),
            compute_path(self.compute),
            observing_attention(decoder, observer),
        ):
            run(observer)
        seconds = time.perf_counter() - started

        def heads(store: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
            """float32 on the CPU; a layer never observed gets one zero per head."""
            return tuple(h.float().cpu() if h is not None else torch.zeros(1) for h in store)

        return Observation(
            heads(observer.k_heads),
            heads(observer.v_heads),
            tuple(observer.observed),
            paths,
            seconds,
            q_heads=heads(observer.q_heads) if observer.queries else (),
            q_observed=tuple(observer.q_observed) if observer.queries else (),
            attention_classes=tuple(
                sorted({type(model.get_submodule(p)).__name__ for p in paths.values()})
            ),
            samples=tuple(tuple(layer) for layer in sampler.samples) if sampler is not None else (),
        )


@dataclass(frozen=True)
class Observation:
    """What an engine measured: absmax of K/V per layer and KV head (Q per query head, if asked), float32, CPU."""

    k_heads: tuple[
        torch.Tensor, ...
    ]  # per layer: [kv_heads] (or [1] from an engine that sees only tensors)
    v_heads: tuple[torch.Tensor, ...]
    observed: tuple[int, ...]  # forward passes that reached each layer (0: never observed)
    attention_paths: dict[int, str]  # layer -> state-dict path of its attention module
    seconds: float  # time spent observing (for tokens/s)
    q_heads: tuple[
        torch.Tensor, ...
    ] = ()  # per layer: [attention heads]; () when Q was not observed
    q_observed: tuple[int, ...] = ()
    attention_classes: tuple[
        str, ...
    ] = ()  # the attention modules' class names (FP8-attention config targets)
    samples: tuple[
        tuple[AttentionSample, ...], ...
    ] = ()  # per layer: the scale objective's (this rank's)


Engine = Callable[[EngineInputs], Observation]
