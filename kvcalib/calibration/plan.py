"""`calibrate --plan`: what a run would do and take, before it runs; nothing is written (leftovers are left).

calibrate's checks run as they would (what stops the run is a refusal, not raised); then a timed probe: the run's
first batches (longest first) through its engine (stream: the first PROBE_LAYERS layers), PROBE_BATCHES at least and
every one the objective samples, then the objective's search on the first PROBE_LAYERS layers: on the run's own
sequences, since its cost is per sequence more than per token (16 query rows each). The estimate scales each part by
what the run has more of: load (checks, data, weights), observe, objective (the search, by layers) and write."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvcalib.calibration.objective import search
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import ENGINES, RunPlan, check_run, engine_inputs, read_data
from kvcalib.calibration.writer import measure_room
from kvcalib.core.errors import KvcalibError, UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.core.schema import (
    ATTN_HEAD,
    KvCacheSize,
    kv_cache_size,
    num_hidden_layers,
    text_config,
)
from kvcalib.hf.memory import HEADROOM, peak_rss_bytes, weight_bytes

__all__ = [
    "PROBE_BATCHES",
    "PROBE_LAYERS",
    "CalibrationPlan",
    "Estimate",
    "Probe",
    "plan_calibration",
]

PROBE_BATCHES = 2  # two, so a batch's compute is told apart from what a run pays once
PROBE_LAYERS = (
    2  # the stream engine's probe: two layers, so a layer's load is told apart from its compute
)
WRITE_BYTES_PER_S = (
    200e6  # copying weights where hard links do not work (an assumption, not measured)
)
VALIDATE_SECONDS = (
    0.1  # writing config, card, scales, links, then validate: 0.01-0.03 s (SmolLM2, Qwen2.5-0.5B)
)


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

    JSON = {"total": "total"}


@dataclass(frozen=True)
class Probe:
    """The timed probe in CalibrationPlan's probe: engine (the one timed), batches, layers and tokens it ran on,
    objective_tokens (the objective's search ran on: the run's own) and run_objective_tokens (the run's),
    objective_layers (searched), seconds, objective_seconds (of the search) and objective_first_seconds (its first
    layer's, with what the run pays once), peak_rss_bytes; from its progress events: load_seconds (paid
    once), compute_seconds (the probed batches: native the whole model, stream one layer), layer_load_seconds
    (stream: one layer's load); setup_seconds (calibrate's checks and data, before the engine)."""

    engine: str
    batches: int
    layers: int
    tokens: int
    objective_tokens: int
    run_objective_tokens: int
    objective_layers: int
    seconds: float
    objective_seconds: float
    objective_first_seconds: float
    peak_rss_bytes: int
    load_seconds: float
    compute_seconds: float
    layer_load_seconds: float
    setup_seconds: float


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` would do; to_json() is `calibrate --plan --json`. model, output, refusals (what would stop the
    run; then the rest is null or 0), target, engine, engine_reason, compute, num_layers, num_samples, num_tokens,
    token_budget (why that many), weight_bytes (in the calibration dtype), peak_memory_bytes (estimated),
    memory_limit_bytes, memory_source (null: no limit), weights_linked (or copied), output_bytes (new on its
    filesystem), free_bytes, scratch_bytes (the stream engine's spill, at most), probe (Probe; {} with refusals),
    estimate_seconds (load, observe, objective, write, total), kv_cache."""

    model: str
    output: str
    refusals: tuple[str, ...] = ()
    target: str | None = None
    engine: str | None = None
    engine_reason: str | None = None
    compute: str | None = None
    num_layers: int | None = None
    num_samples: int = 0
    num_tokens: int = 0
    token_budget: str = ""
    weight_bytes: int = 0
    peak_memory_bytes: int = 0
    memory_limit_bytes: int | None = None
    memory_source: str | None = None
    weights_linked: bool = True
    output_bytes: int = 0
    free_bytes: int = 0
    scratch_bytes: int = 0
    probe: Probe | None = None
    estimate: Estimate | None = None
    kv_cache: KvCacheSize | None = None

    @property
    def ok(self) -> bool:
        return not self.refusals

    JSON = {
        "estimate": None,
        "estimate_seconds": "estimate",
        "probe": lambda plan: plan.probe or {},
    }


def plan_calibration(
    model: str | Path,
    dataset: str,
    output: str | Path,
    options: CalibrateOptions | None = None,
    progress: ProgressCallback | None = None,
) -> CalibrationPlan:
    """The plan of `calibrate(...)`: UsageError as calibrate raises it; whatever else stops the run, a refusal."""
    notify, opts = progress or no_progress, options or CalibrateOptions()
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
        refusal = err.message + (f" ({err.hint})" if err.hint else "")
        return CalibrationPlan(str(model), str(output), refusals=(refusal,))
    layers = num_hidden_layers(plan.checkpoint.config) or 1
    setup = (
        time.perf_counter() - began
    )  # check_run and read_data: what the run does before its engine
    probe = _probe(plan, data, pad, layers, notify, round(setup, 3))
    needed = weight_bytes(plan.checkpoint, plan.dtype)
    peak, scratch = _memory(plan, data, needed, layers)
    limit = plan.engine.limit or plan.machine.memory  # --max-memory's cap, as check_run resolved it
    return CalibrationPlan(
        model=str(model),
        output=str(output),
        target=plan.target.name,
        engine=plan.engine.engine,
        engine_reason=plan.engine.reason,
        compute=plan.compute.describe(),
        num_layers=layers,
        num_samples=len(data.sequences),
        num_tokens=data.num_tokens,
        token_budget=plan.options.token_budget(data),
        weight_bytes=needed,
        peak_memory_bytes=peak,
        memory_limit_bytes=limit.available if limit else None,
        memory_source=limit.source if limit else None,
        weights_linked=room.linkable,
        output_bytes=room.needed,
        free_bytes=room.free,
        scratch_bytes=scratch,
        probe=probe,
        estimate=_estimate(probe, data.num_tokens, layers, room.needed, room.linkable),
        kv_cache=kv_cache_size(plan.checkpoint.config),
    )


def _probe(
    plan: RunPlan, data: Any, pad: int, layers: int, notify: ProgressCallback, setup: float
) -> Probe:
    """Time the run's engine on its first batches (see the module docstring), then the objective's search."""
    opts = plan.options
    sampled = engine_inputs(plan, data, pad, no_progress).sample_sequences  # the run's objective's
    order = sorted(data.sequences, key=len, reverse=True)  # as the engines batch them
    seen: set[tuple[int, ...]] = set()
    count = opts.batch_size * PROBE_BATCHES
    for i, seq in enumerate(order):  # the objective's are the first whole batches
        if len(seen) == len(sampled):
            count = max(count, i)
            break
        seen.update({tuple(seq)} & sampled)
    else:
        count = len(order)
    rows = tuple(order[:count])
    probe_data = replace(data, sequences=rows)
    engine = plan.engine.engine
    stream = engine == "stream"
    probed = min(PROBE_LAYERS, layers)
    stamps: list[tuple[float, Progress]] = []

    def stamp(event: Progress) -> None:
        stamps.append((time.perf_counter(), event))
        notify(event)

    name = "native" if engine == "llmcompressor" else engine  # oneshot: native's probe
    inputs = engine_inputs(plan, probe_data, pad, stamp, probe_layers=probed if stream else None)
    started = time.perf_counter()
    observation = ENGINES[name](inputs)
    observed = time.perf_counter()
    times: list[float] = []  # the search's, layer by layer: the first pays what the run pays once
    ob, per_head = observation, plan.recipe.strategy == ATTN_HEAD
    for i in range(probed) if inputs.sample_sequences else ():
        began, one = time.perf_counter(), slice(i, i + 1)
        search(ob.samples[one], ob.k_heads[one], ob.v_heads[one], plan.target, per_head)
        times.append(time.perf_counter() - began)
    return Probe(
        engine=name,
        batches=math.ceil(len(rows) / opts.batch_size),
        layers=layers if not stream else probed,
        tokens=probe_data.num_tokens,
        objective_tokens=sum(len(s) for s in inputs.sample_sequences),
        run_objective_tokens=sum(len(s) for s in sampled),
        objective_layers=probed if inputs.sample_sequences else 0,
        seconds=round(observed - started + sum(times), 3),
        objective_seconds=round(sum(times), 3),
        objective_first_seconds=round(times[0] if times else 0.0, 3),
        peak_rss_bytes=peak_rss_bytes(),
        **_split(stamps, started, observed, stream),
        setup_seconds=setup,
    )


def _split(
    stamps: list[tuple[float, Progress]], started: float, ended: float, stream: bool
) -> dict[str, float]:
    """The probe's time from its progress events: paid once (load), per layer (stream loads), per batch."""
    observe = [(t, e) for t, e in stamps if e.stage == "observe"]
    if not stream:  # native: "observe" 0 after the load, then one after each batch
        first = observe[0][0] if observe else ended
        return {
            "load_seconds": round(first - started, 4),
            "compute_seconds": round(ended - first, 4),
            "layer_load_seconds": 0.0,
        }
    by_layer: dict[int, list[float]] = {}
    for t, e in observe:
        by_layer.setdefault(e.layer, []).append(t)
    firsts, lasts = (
        sorted(times[0] for times in by_layer.values()),
        sorted(times[-1] for times in by_layer.values()),
    )
    batches = max(len(times) for times in by_layer.values()) if by_layer else 1
    compute_one = (
        sum(times[-1] - times[0] for times in by_layer.values()) / len(by_layer) / (batches - 1)
        if by_layer and batches > 1
        else 0.0
    )
    cycle = (
        lasts[-1] - lasts[-2]
        if len(lasts) > 1
        else (lasts[0] - started if lasts else ended - started)
    )
    layer_load = max(cycle - batches * compute_one, 0.0) if batches > 1 else 0.0
    compute = (cycle - layer_load) if batches > 1 else cycle
    first = firsts[0] if firsts else ended
    return {
        "load_seconds": round(max(first - started - layer_load - compute_one, 0.0), 4),
        "compute_seconds": round(compute, 4),  # one layer, every probed batch
        "layer_load_seconds": round(layer_load, 4),
    }


def _estimate(probe: Probe, tokens: int, layers: int, output_bytes: int, linked: bool) -> Estimate:
    stream = probe.engine == "stream"
    per_token = (
        probe.compute_seconds / max(probe.tokens, 1) * (layers if stream else 1)
    )  # the model
    loads = probe.layer_load_seconds * layers  # stream: every layer loaded, once a pass
    first, searched = probe.objective_first_seconds, probe.objective_layers
    rest = (probe.objective_seconds - first) / (searched - 1) if searched > 1 else first
    objective = first + rest * (layers - 1) if searched else 0.0
    write = VALIDATE_SECONDS + (0.0 if linked else output_bytes / WRITE_BYTES_PER_S)
    return Estimate(
        probe.setup_seconds + probe.load_seconds,
        per_token * tokens + loads,
        objective,
        write,
    )


def _memory(plan: RunPlan, data: Any, weights: int, layers: int) -> tuple[int, int]:
    """(peak, scratch) bytes: the weights x HEADROOM; stream: two layers and the hidden states (or one batch's)."""
    if plan.engine.engine != "stream":
        return int(weights * HEADROOM), 0
    hidden = int(text_config(plan.checkpoint.config).get("hidden_size") or 0)
    element = plan.dtype.itemsize if plan.dtype is not None else 2
    longest = max((len(s) for s in data.sequences), default=0)
    states = len(data.sequences) * longest * hidden * element
    limit, one_layer = plan.engine.limit or plan.machine.memory, weights // max(layers, 1)
    if limit is not None and states + 2 * one_layer > limit.available:
        return 2 * one_layer + plan.options.batch_size * longest * hidden * element, states
    return 2 * one_layer + states, 0
