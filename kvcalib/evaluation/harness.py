"""kvcalib's FP8-KV emulation as an lm-eval-harness model (lm-eval 0.4.13, the `[tasks]` extra).

Importing this module registers the lm-eval model "kvcalib" (lm-eval has no plugin discovery, so its own command
line cannot see it: call it from Python, or use `kvcalib eval CKPT --tasks ...`):

    import lm_eval, kvcalib.evaluation.harness
    lm_eval.simple_evaluate(model="kvcalib", model_args="pretrained=CKPT,target=trn2,scales=checkpoint",
                            tasks=["lambada_openai"])

`scales`: `checkpoint` (its own k_scale/v_scale), `unit` (every scale 1.0), `none` (no quantisation: the baseline)
or another checkpoint's path. The model is lm-eval's HFLM whose every forward, scoring and generation alike, gets a
ObservedCache: K/V stored as the target stores them (KVQuantizer), read back by every later token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.cpu import ComputePath, HostCpu
from kvcalib.core.fp8 import DEFAULT_TARGET
from kvcalib.core.options import ModelOptions
from kvcalib.evaluation.emulate import KVQuantizer
from kvcalib.evaluation.pipeline import CHECKPOINT, UNIT, Prepared, scale_set
from kvcalib.hf.attention import ObservedCache
from kvcalib.hf.compute import Float32Weights, compute_path
from kvcalib.hf.internals import cache_kwargs
from kvcalib.hf.model import resolve_target

__all__ = ["BASELINE", "CHECKPOINT", "UNIT", "KvcalibLM", "LoadedModel", "load"]

BASELINE = "none"  # scales=none: no quantisation


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint's model and tokenizer in memory, shared by every scale set a run compares."""

    checkpoint: Checkpoint
    model: torch.nn.Module
    tokenizer: Any
    compute: ComputePath
    weights: Float32Weights  # float32 copies of the weights, kept across forwards (when compute is emulated)


def load(checkpoint: str | Path, options: ModelOptions) -> LoadedModel:
    """The model as `kvcalib eval` loads it (faithful attention, the compute path for this CPU)."""
    job = Prepared.open(checkpoint, options, HostCpu.detect(with_capability=False))
    return LoadedModel(
        job.run.checkpoint, job.model(), job.tokenizer(), job.compute, Float32Weights()
    )


@register_model("kvcalib")
class KvcalibLM(HFLM):
    """lm-eval's HFLM whose KV cache is stored in FP8 as `target` stores it (see the module docstring)."""

    _continuation = 0  # while lm-eval scores continuations: the longest one (_logits_to_keep)

    def __init__(
        self,
        pretrained: str | LoadedModel,
        target: str = DEFAULT_TARGET,
        scales: str = CHECKPOINT,
        bf16_compute: str = "auto",
        dtype: str = "auto",
        device: str = "cpu",
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        self.loaded = loaded = (
            pretrained
            if isinstance(pretrained, LoadedModel)
            else load(
                pretrained,
                ModelOptions(dtype, device, bool(trust_remote_code), bf16_compute),
            )
        )
        # the baseline (scales=none; lm-eval's model_args parser turns "none" into None) has no quantiser
        self.quantizer = None
        if scales is not None and str(scales).lower() != BASELINE:
            chip = resolve_target(target)
            chosen = scale_set(str(scales), loaded.checkpoint, chip, what=f"scales={scales}")
            self.quantizer = KVQuantizer(chosen.k, chosen.v, chip)
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, **kwargs)

    def _cache(self) -> dict[str, Any]:
        """The model's keywords for a new cache that stores K/V through the quantiser."""
        cache = ObservedCache(self.model.config, self.quantizer and self.quantizer.observe)
        return cache_kwargs(self.model, cache)

    def _loglikelihood_tokens(self, requests: list, *args: Any, **kwargs: Any) -> list:
        # the longest continuation: _model_call's logits need cover no more than that past each row's end
        self._continuation = max((len(continuation) for _, _, continuation in requests), default=0)
        try:
            return super()._loglikelihood_tokens(requests, *args, **kwargs)
        finally:
            self._continuation = 0

    def _logits_to_keep(self, inps: torch.Tensor) -> int:
        """How many last positions of `inps` lm-eval reads logits at (0: all): the longest continuation plus a row's
        most right padding (trailing zeros, lm-eval's padding). HFLM slices continuations from the end of the
        logits, so this scores the same, with the LM head over a few positions (Gemma 3: most of a forward)."""
        if not self._continuation:
            return 0
        padding = (inps != 0).flip(1).cumsum(1).eq(0).sum(1)  # each row's trailing zeros
        keep = self._continuation + int(padding.max())
        return 0 if keep >= inps.shape[1] else keep

    def _model_call(
        self, inps: torch.Tensor, attn_mask: Any = None, labels: Any = None
    ) -> torch.Tensor:
        """Every run, the baseline too (no quantiser), through the same cache and LM-head slice."""
        keep = self._logits_to_keep(inps)
        with compute_path(self.loaded.compute, self.loaded.weights), torch.no_grad():
            return self.model(inps, **self._cache(), use_cache=True, logits_to_keep=keep).logits

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ) -> torch.Tensor:
        generation_kwargs.update(self._cache())
        with compute_path(self.loaded.compute, self.loaded.weights):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
