"""The engine contract: what an observation engine gets (EngineInputs) and returns (Observation).

Engines (native, stream, llmcompressor) import this module and nothing above it; the
pipeline names them in one table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcalib.calibrate.memory import MemoryLimit
from kvcalib.calibrate.options import CalibrateOptions
from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.cpu import NATIVE, ComputePath
from kvcalib.core.progress import ProgressCallback
from kvcalib.hf.data import CalibrationData

__all__ = ["Engine", "EngineInputs", "Observation"]


@dataclass(frozen=True)
class EngineInputs:
    """What an observation engine gets: everything checked and loaded except the weights."""

    checkpoint: Checkpoint  # config.json and the safetensors headers, read once
    data: CalibrationData
    options: CalibrateOptions
    dtype: torch.dtype | None  # None: the checkpoint's own dtype
    device: torch.device
    pad_id: int
    notify: ProgressCallback
    compute: ComputePath = ComputePath(NATIVE, "not chosen")
    memory: MemoryLimit | None = None  # this host's memory limit (the stream engine sizes its spill by it)

    @property
    def model_dir(self) -> Path:
        return self.checkpoint.root

    @property
    def config(self) -> dict[str, Any]:
        return self.checkpoint.config


@dataclass(frozen=True)
class Observation:
    """What an engine measured: per-layer absmax of K and V over every calibration token."""

    k_absmax: torch.Tensor  # [num_layers] float32, on the CPU
    v_absmax: torch.Tensor  # [num_layers] float32, on the CPU
    observed: tuple[int, ...]  # forward passes that reached each layer (0: never observed)
    attention_paths: dict[int, str]  # layer -> state-dict path of its attention module
    seconds: float  # time spent observing (for tokens/s)


Engine = Callable[[EngineInputs], Observation]
