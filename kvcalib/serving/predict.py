"""kvcalib's prediction of what the server should measure: prompts.NLL_TEXT through kvcalib's eval emulation with
the serving chip's numerics (core.fp8.EMULATED) and order (fp8.Target.order), the checkpoint's, the canary's and 1.0
scales. `delta_intervals` pairs served and predicted ΔNLL token by token, a block bootstrap over BLOCK_TOKENS
consecutive tokens."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvcalib.core.checkpoint import Checkpoint
from kvcalib.serving.prompts import NLL_TEXT

if TYPE_CHECKING:
    from kvcalib.evaluation.significance import Interval

__all__ = ["DeltaIntervals", "Prediction", "delta_intervals", "predict"]

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Prediction:
    target: str  # the numerics emulated
    baseline_nll: float  # unquantised KV
    nll: float  # the checkpoint's scales
    delta_nll: float
    unit_delta_nll: float | None = None  # every scale 1.0
    canary_delta_nll: float | None = None  # the canary's scales
    seconds: float = 0.0
    token_delta: tuple[
        float, ...
    ] = ()  # per scored token: the checkpoint's NLL minus the unquantised one
    order: str = ""  # the order scored (fp8.NEURON_ORDER, fp8.GPU_ORDER): the server's

    JSON = {"token_delta": None}


@dataclass(frozen=True)
class DeltaIntervals:
    """The calibrated scales' ΔNLL on the probe text in ServeCheckResult's delta_nll intervals: served, predicted and
    served_minus_predicted (each an Interval over blocks of BLOCK_TOKENS tokens; null: nothing to pair)."""

    served: Interval | None = None
    predicted: Interval | None = None
    served_minus_predicted: Interval | None = None


def predict(
    checkpoint: Path,
    target: str,
    canary: Path | None,
    unit: bool,
    memory: int | None,
    warnings: list[str],
) -> Prediction | None:
    """The emulated NLLs of prompts.NLL_TEXT (one sample, as the server scores it) for the checkpoint's scales and the
    others, in-process on CPU; None (with a warning) where the model needs more than half of `memory` (None: what
    this host has free) in float32. kvcalib.evaluation (torch) is imported here so that `import kvcalib.serving`
    stays light."""
    weights = Checkpoint.open(checkpoint).weight_bytes(4)  # the emulation runs in float32 at worst
    if memory is None:
        from kvcalib.hf.memory import available_memory

        memory = available_memory().available
    if weights > memory // 2:
        warnings.append(
            f"no prediction: the model needs about {weights / 2**30:.1f} GiB in float32, more than half "
            f"of the {memory / 2**30:.1f} GiB this run may use"
        )
        return None
    from kvcalib.evaluation.pipeline import UNIT, EvalOptions, evaluate

    compare = ((UNIT,) if unit else ()) + ((str(canary),) if canary is not None else ())
    with tempfile.TemporaryDirectory(prefix="kvcalib-predict-") as tmp:
        data = Path(tmp) / "probe.jsonl"
        data.write_text(json.dumps({"text": NLL_TEXT}) + "\n", encoding="utf-8")
        result = evaluate(
            checkpoint,
            str(data),
            EvalOptions(
                target=target,
                num_samples=1,
                max_seq_len=4096,
                batch_size=1,
                compare=compare,
                layer_rows=0,
            ),
        )
    runs, own = {run.name: run for run in result.runs}, result.runs[0]
    return Prediction(
        target,
        result.baseline_nll,
        own.nll,
        own.delta_nll,
        runs[UNIT].delta_nll if unit else None,
        canary and runs[str(canary)].delta_nll,
        result.seconds,
        tuple((own.token_nll - result.baseline_token_nll).tolist()),
        result.order,
    )


def delta_intervals(
    baseline: Sequence[float] | None,
    fp8: Sequence[float],
    prediction: Prediction | None,
    warnings: list[str],
) -> DeltaIntervals:
    """The intervals from per-token NLLs; why one is missing is appended to `warnings`."""
    from kvcalib.evaluation.significance import paired_bootstrap

    def interval(values: Sequence[float] | None) -> Interval | None:
        if values is None:
            return None
        blocks = [values[i : i + BLOCK_TOKENS] for i in range(0, len(values), BLOCK_TOKENS)]
        found = paired_bootstrap([sum(b) for b in blocks], [len(b) for b in blocks])
        return found and replace(
            found,
            method=f"paired bootstrap over blocks of {BLOCK_TOKENS} tokens, "
            f"{found.method.split(', ', 1)[1]}",
        )

    predicted, served, difference = prediction and prediction.token_delta, None, None
    if baseline is not None and len(baseline) != len(fp8):
        warnings.append(
            f"the baseline server scored {len(baseline)} tokens and the FP8 server {len(fp8)}: no served "
            "interval"
        )
    elif baseline is not None:
        served = [f - b for f, b in zip(fp8, baseline)]
        if predicted is not None and len(predicted) != len(served):
            warnings.append(
                f"the servers scored {len(served)} tokens, the prediction {len(predicted)}: the two "
                "tokenised the text differently, so served and predicted are not paired"
            )
        elif predicted is not None:
            difference = [s - p for s, p in zip(served, predicted)]
    return DeltaIntervals(interval(served), interval(predicted), interval(difference))
