"""`calibrate --plan`: what a run would do and what it would take, before it runs; nothing is written.

Every check calibrate makes before its long work runs as it would (the model, the recipe, the output path, the
room on the output's filesystem, the engine the memory allows); what would stop the run is reported as a
refusal instead of raised. Then a timed probe: the first PROBE_BATCHES batches of the real samples through the
engine the run would use (the in-memory engine: the whole model loaded, as the run loads it; the stream engine:
the first PROBE_LAYERS layers only, each loaded from disk as the run loads it), and the scale objective's search
on what the probe observed. The estimate scales each measured part by what the run has more of:

- load: the checks and the data as the run makes them (in a fresh process that includes importing transformers,
  which a run pays too), then the model's load (in memory) or the stream engine's start-up (skeleton,
  embeddings, the first inputs);
- observe: the probe's per-token compute time times the run's tokens (per layer for the stream engine, which
  also pays each layer's load once);
- objective: the probe's search time times (the run's objective tokens / the probe's) and (layers / probed);
- write: hard links cost nothing; copied bytes at WRITE_BYTES_PER_S, plus validate (a fixed second).

Leftovers of interrupted runs are left as they are; the room check writes and removes one probe file.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcalib.calibration.objective import search
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import ENGINES, RunPlan, check_run, engine_inputs, read_data
from kvcalib.calibration.writer import measure_room
from kvcalib.core.errors import KvcalibError, UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.core.schema import ATTN_HEAD, num_hidden_layers, text_config
from kvcalib.hf.memory import HEADROOM, peak_rss_bytes, weight_bytes

__all__ = ["PROBE_BATCHES", "PROBE_LAYERS", "CalibrationPlan", "Estimate", "plan_calibration"]

PROBE_BATCHES = 2  # two, so a batch's compute is told apart from what a run pays once
PROBE_LAYERS = 2  # the stream engine's probe: two layers, so a layer's load is told apart from its compute
WRITE_BYTES_PER_S = 200e6  # copying weights where hard links do not work (an assumption, not measured)
# the config, card, scales and links, then validate: 0.01-0.03 s measured (SmolLM2, Qwen2.5-0.5B)
VALIDATE_SECONDS = 0.1


@dataclass(frozen=True)
class Estimate:
    """Seconds the run would take, by part (see the module docstring)."""

    load: float
    observe: float
    objective: float
    write: float

    @property
    def total(self) -> float:
        return self.load + self.observe + self.objective + self.write

    def to_dict(self) -> dict[str, float]:
        return {"load": round(self.load, 2), "observe": round(self.observe, 2), "objective": round(self.objective, 2),
                "write": round(self.write, 2), "total": round(self.total, 2)}


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` would do with these arguments (`.to_dict()` is `calibrate --plan --json`)."""

    model: str
    output: str
    refusals: tuple[str, ...] = ()  # what would stop the run (nothing else is filled in then)
    target: str | None = None
    engine: str | None = None
    engine_reason: str | None = None
    compute: str | None = None
    num_layers: int | None = None
    num_samples: int = 0
    num_tokens: int = 0
    weight_bytes: int = 0  # in the calibration dtype
    peak_memory_bytes: int = 0  # estimated
    memory_limit_bytes: int | None = None
    memory_source: str | None = None
    weights_linked: bool = True  # hard links (no space) or copies
    output_bytes: int = 0  # new bytes on the output's filesystem
    free_bytes: int = 0
    scratch_bytes: int = 0  # the stream engine's spilled hidden states, at most
    probe: dict[str, Any] = field(default_factory=dict)
    estimate: Estimate | None = None

    @property
    def ok(self) -> bool:
        return not self.refusals

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "estimate"}
        out["refusals"] = list(self.refusals)
        out["estimate_seconds"] = None if self.estimate is None else self.estimate.to_dict()
        return out


def plan_calibration(model: str | Path, dataset: str, output: str | Path, options: CalibrateOptions | None = None,
                     progress: ProgressCallback | None = None) -> CalibrationPlan:
    """The plan of `calibrate(model, dataset, output, options)` (see the module docstring). Wrong arguments raise
    UsageError as calibrate does; anything else that would stop the run is a refusal in the plan."""
    notify = progress or no_progress
    opts = options or CalibrateOptions()
    opts.check_arguments()
    began = time.perf_counter()
    try:
        plan = check_run(model, dataset, Path(output), opts, dry=True)
        room = measure_room(Path(output), plan.checkpoint)
        notify(Progress("load-data"))
        data, pad = read_data(plan, dataset)
    except UsageError:
        raise
    except KvcalibError as err:
        return CalibrationPlan(str(model), str(output),
                               refusals=(err.message + (f" ({err.hint})" if err.hint else ""),))
    layers = num_hidden_layers(plan.checkpoint.config) or 1
    setup = time.perf_counter() - began  # check_run and read_data: what the run does before its engine
    probe = {**_probe(plan, data, pad, layers, notify), "setup_seconds": round(setup, 3)}
    needed = weight_bytes(plan.checkpoint, plan.dtype)
    peak, scratch = _memory(plan, data, needed, layers)
    limit = plan.engine.limit or opts.memory
    return CalibrationPlan(
        model=str(model), output=str(output), target=plan.target.name, engine=plan.options.engine,
        engine_reason=plan.engine.reason, compute=plan.compute.describe(), num_layers=layers,
        num_samples=len(data.sequences), num_tokens=data.num_tokens, weight_bytes=needed, peak_memory_bytes=peak,
        memory_limit_bytes=limit.available if limit else None, memory_source=limit.source if limit else None,
        weights_linked=room.linkable, output_bytes=room.needed, free_bytes=room.free, scratch_bytes=scratch,
        probe=probe, estimate=_estimate(probe, data.num_tokens, layers, room.needed, room.linkable),
    )


def _probe(plan: RunPlan, data: Any, pad: int, layers: int, notify: ProgressCallback) -> dict[str, Any]:
    """Time the run's engine on its first PROBE_BATCHES batches (the stream engine: its first PROBE_LAYERS layers),
    then the scale objective on what it observed."""
    opts = plan.options
    rows = data.sequences[:opts.batch_size * PROBE_BATCHES]
    probe_data = replace(data, sequences=rows)
    stream = plan.options.engine == "stream"
    probed = min(PROBE_LAYERS, layers) if stream else layers
    stamps: list[tuple[float, Progress]] = []

    def stamp(event: Progress) -> None:
        stamps.append((time.perf_counter(), event))
        notify(event)

    name = "native" if plan.options.engine == "llmcompressor" else plan.options.engine  # oneshot: native's probe
    engine = ENGINES[name]
    inputs = engine_inputs(plan, probe_data, pad, stamp, probe_layers=probed if stream else None)
    started = time.perf_counter()
    observation = engine(inputs)
    observed = time.perf_counter()
    objective = 0.0
    if inputs.sample_sequences:
        search([s for s in observation.samples[:probed]], observation.k_heads[:probed],
               observation.v_heads[:probed], plan.target, plan.recipe.strategy == ATTN_HEAD)
        objective = time.perf_counter() - observed
    sampled = sum(len(s) for s in engine_inputs(plan, data, pad, no_progress).sample_sequences)
    return {
        "engine": name,
        "batches": math.ceil(len(rows) / opts.batch_size), "layers": probed, "tokens": probe_data.num_tokens,
        "objective_tokens": sum(len(s) for s in inputs.sample_sequences), "run_objective_tokens": sampled,
        "seconds": round(observed - started + objective, 3), "objective_seconds": round(objective, 3),
        "peak_rss_bytes": peak_rss_bytes(), **_split(stamps, started, observed, stream),
    }


def _split(stamps: list[tuple[float, Progress]], started: float, ended: float, stream: bool) -> dict[str, float]:
    """The probe's time by part, from its progress events: what is paid once (load), per layer (the stream
    engine's layer loads) and per batch of compute."""
    observe = [(t, e) for t, e in stamps if e.stage == "observe"]
    if not stream:  # native: "observe" 0 after the load, then one after each batch
        first = observe[0][0] if observe else ended
        return {"load_seconds": round(first - started, 4), "compute_seconds": round(ended - first, 4),
                "layer_load_seconds": 0.0}
    by_layer: dict[int, list[float]] = {}
    for t, e in observe:
        by_layer.setdefault(e.layer, []).append(t)
    firsts = sorted(times[0] for times in by_layer.values())
    lasts = sorted(times[-1] for times in by_layer.values())
    batches = max(len(times) for times in by_layer.values()) if by_layer else 1
    compute_one = (sum(times[-1] - times[0] for times in by_layer.values()) / len(by_layer) / (batches - 1)
                   if by_layer and batches > 1 else 0.0)
    cycle = lasts[-1] - lasts[-2] if len(lasts) > 1 else (lasts[0] - started if lasts else ended - started)
    layer_load = max(cycle - batches * compute_one, 0.0) if batches > 1 else 0.0
    compute = (cycle - layer_load) if batches > 1 else cycle
    first = firsts[0] if firsts else ended
    return {"load_seconds": round(max(first - started - layer_load - compute_one, 0.0), 4),
            "compute_seconds": round(compute, 4),  # one layer, every probed batch
            "layer_load_seconds": round(layer_load, 4)}


def _estimate(probe: dict[str, Any], tokens: int, layers: int, output_bytes: int, linked: bool) -> Estimate:
    scale = tokens / max(probe["tokens"], 1)
    per_layer = probe["engine"] == "stream"
    observe = probe["compute_seconds"] * scale * (layers if per_layer else 1) + probe["layer_load_seconds"] * layers
    objective = probe["objective_seconds"] * probe["run_objective_tokens"] / max(probe["objective_tokens"], 1) \
        * layers / max(probe["layers"], 1)
    write = VALIDATE_SECONDS + (0.0 if linked else output_bytes / WRITE_BYTES_PER_S)
    return Estimate(probe["setup_seconds"] + probe["load_seconds"], observe, objective, write)


def _memory(plan: RunPlan, data: Any, weights: int, layers: int) -> tuple[int, int]:
    """(peak bytes, scratch bytes): the in-memory engine holds the weights (HEADROOM, its own rule); the stream
    engine one layer, the rest of the model and every batch's hidden states (spilled to disk where they would
    not fit: then one batch in memory and the rest on disk)."""
    if plan.options.engine != "stream":
        return int(weights * HEADROOM), 0
    hidden = int(text_config(plan.checkpoint.config).get("hidden_size") or 0)
    element = (plan.dtype.itemsize if plan.dtype is not None else 2)
    longest = max((len(s) for s in data.sequences), default=0)
    states = len(data.sequences) * longest * hidden * element
    limit = plan.engine.limit or plan.options.memory
    one_layer = weights // max(layers, 1)
    if limit is not None and states + 2 * one_layer > limit.available:
        batch = plan.options.batch_size * longest * hidden * element
        return 2 * one_layer + batch, states
    return 2 * one_layer + states, 0
