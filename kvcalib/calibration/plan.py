"""`calibrate --plan`: what a run would do and take, before it runs; nothing is written (leftovers are left).

calibrate's checks run as they would (what stops the run is a refusal, not raised); then a timed probe, whatever
engine the run uses: the rows the objective samples (the run's first whole batches, longest first), at most half of
them a batch (a batch's compute told apart from a layer's load), through the first PROBE_LAYERS decoder layers with
the stream engine (a layer computes as in the whole model), then the objective's search on those layers' samples:
the run's own. The estimate scales each part by what the run has more of: load (checks, data, the weights: per
layer, by layers), observe (a layer's compute, by tokens and layers), objective (by layers) and write. The peak
memory: _memory's terms, the compute dtype's among them (bf16 computed in float32 holds float32 activations)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvcalib.calibration.objective import search
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import RunPlan, check_run, engine_inputs, read_data
from kvcalib.calibration.stream import stream_engine
from kvcalib.calibration.writer import measure_room
from kvcalib.core.errors import KvcalibError, UnsupportedModelError, UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.core.schema import (
    ATTN_HEAD,
    KvCacheSize,
    kv_cache_size,
    num_hidden_layers,
    text_config,
)
from kvcalib.hf.memory import proc_status, weight_bytes

__all__ = ["PROBE_LAYERS", "CalibrationPlan", "Estimate", "Probe", "plan_calibration"]

PROBE_LAYERS = 2  # two, so a layer's load is told apart from what a run pays once
# copying weights where hard links do not work (an assumption, not measured)
WRITE_BYTES_PER_S = 200e6
VALIDATE_SECONDS = 0.1  # config, card, scales, links, validate: 0.01-0.03 s (SmolLM2, Qwen2.5-0.5B)


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
    """The timed probe in CalibrationPlan's probe: batches, layers and tokens it ran (stream engine), seconds (in
    all), from its progress events: load_seconds (the rest of the model, paid once), layer_load_seconds (one layer),
    compute_seconds (one layer, every probed batch); objective_seconds (the search on `layers`, the first with what
    the run pays once: objective_first_seconds), setup_seconds (calibrate's checks and data, before the engine),
    base_rss_bytes (this process then), sample_bytes (the objective's samples, one layer)."""

    batches: int
    layers: int
    tokens: int
    seconds: float
    load_seconds: float
    layer_load_seconds: float
    compute_seconds: float
    objective_seconds: float
    objective_first_seconds: float
    setup_seconds: float
    base_rss_bytes: int
    sample_bytes: int


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` would do; to_json() is `calibrate --plan --json`. model, output, refusals (what would stop the
    run; then the rest is null or 0), target, engine, engine_reason, compute, num_layers, num_samples, num_tokens,
    token_budget (why that many), weight_bytes (in the calibration dtype), peak_memory_bytes (estimated: hf.memory's
    peak_bytes), memory_limit_bytes, memory_source (null: no limit), weights_linked (or copied), output_bytes (new on
    its filesystem), free_bytes, scratch_bytes (the stream engine's spill, at most), probe (Probe; {} with refusals),
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
    try:
        probe = _probe(plan, data, pad, notify, time.perf_counter() - began)
    except (
        UnsupportedModelError
    ) as err:  # the probe streams layers, whatever engine the run would use
        raise UnsupportedModelError(
            f"--plan cannot time this model: its probe streams layers, and {err.message}",
            hint="calibrate it without --plan (the run itself uses the engine the plan would name)",
        ) from err
    needed = weight_bytes(plan.checkpoint, plan.dtype)
    limit = plan.engine.limit or plan.machine.memory  # --max-memory's cap, as check_run resolved it
    held = probe.base_rss_bytes + probe.sample_bytes * layers
    peak, scratch = _memory(plan, data, needed, layers, held, limit.available)
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
        token_budget=opts.token_budget(data),
        weight_bytes=needed,
        peak_memory_bytes=peak,
        memory_limit_bytes=limit.available,
        memory_source=limit.source,
        weights_linked=room.linkable,
        output_bytes=room.needed,
        free_bytes=room.free,
        scratch_bytes=scratch,
        probe=probe,
        estimate=_estimate(probe, data.num_tokens, layers, room.needed, room.linkable),
        kv_cache=kv_cache_size(plan.checkpoint.config),
    )


def _probe(plan: RunPlan, data: Any, pad: int, notify: ProgressCallback, setup: float) -> Probe:
    """Time the stream engine on the objective's rows and first layers, then the search (the module docstring)."""
    size, base = plan.options.batch_size, proc_status().get("VmRSS", 0)
    sampled = engine_inputs(plan, data, pad, no_progress).sample_sequences  # the run's objective's
    order = sorted(data.sequences, key=len, reverse=True)  # as the engines batch them
    count = max([i + 1 for i, row in enumerate(order) if row in sampled], default=1)
    rows = order[: math.ceil(count / size) * size]
    size = min(size, math.ceil(len(rows) / 2))
    stamps: list[tuple[float, Progress]] = []

    def stamp(event: Progress) -> None:
        stamps.append((time.perf_counter(), event))
        notify(event)

    small = replace(plan, options=replace(plan.options, batch_size=size))
    inputs = engine_inputs(small, replace(data, sequences=tuple(rows)), pad, stamp, PROBE_LAYERS)
    started = time.perf_counter()
    ob = stream_engine(replace(inputs, sample_sequences=sampled))
    observed = time.perf_counter()
    times = []  # the search's, layer by layer: the first pays what the run pays once
    for i in range(min(PROBE_LAYERS, len(ob.samples))):
        searched, one = time.perf_counter(), slice(i, i + 1)
        search(
            ob.samples[one],
            ob.k_heads[one],
            ob.v_heads[one],
            plan.target,
            plan.recipe.strategy == ATTN_HEAD,
        )
        times.append(time.perf_counter() - searched)
    # per layer, the time after each of its batches
    ends = [
        [t for t, e in stamps if e.stage == "observe" and e.layer == i] for i in range(PROBE_LAYERS)
    ]
    ends = [e for e in ends if e]
    per_batch = (ends[0][-1] - ends[0][0]) / (len(ends[0]) - 1) if len(ends[0]) > 1 else 0.0
    cycle = ends[-1][-1] - ends[-2][-1] if len(ends) > 1 else ends[0][-1] - started
    layer_load = max(cycle - len(ends[0]) * per_batch, 0.0) if per_batch else 0.0
    samples = ob.samples[0] if ob.samples else ()
    return Probe(
        batches=len(ends[0]),
        layers=len(ends),
        tokens=sum(map(len, rows)),
        seconds=round(observed - started + sum(times), 3),
        load_seconds=round(max(ends[0][0] - started - layer_load - per_batch, 0.0), 4),
        layer_load_seconds=round(layer_load, 4),
        compute_seconds=round(cycle - layer_load, 4),
        objective_seconds=round(sum(times), 3),
        objective_first_seconds=round(times[0] if times else 0.0, 3),
        setup_seconds=round(setup, 3),
        base_rss_bytes=base,
        sample_bytes=sum(
            t.numel() * t.element_size()
            for s in samples
            for t in vars(s).values()
            if hasattr(t, "element_size")
        ),
    )


def _estimate(probe: Probe, tokens: int, layers: int, output_bytes: int, linked: bool) -> Estimate:
    first, searched = probe.objective_first_seconds, probe.layers if probe.objective_seconds else 0
    rest = (probe.objective_seconds - first) / (searched - 1) if searched > 1 else first
    return Estimate(
        probe.setup_seconds + probe.load_seconds + probe.layer_load_seconds * layers,
        probe.compute_seconds / max(probe.tokens, 1) * tokens * layers,
        first + rest * (layers - 1) if searched else 0.0,
        VALIDATE_SECONDS + (0.0 if linked else output_bytes / WRITE_BYTES_PER_S),
    )


def _memory(
    plan: RunPlan, data: Any, weights: int, layers: int, held: int, available: int
) -> tuple[int, int]:
    """(peak, scratch) bytes: `held` (this process before its engine, the objective's samples), the weights (in
    memory: all but an untied lm_head, which the decoder never reads; streamed: the embeddings, the lm_head and two
    layers), the largest batch's activations (its MLP's: the activation, up_proj's output in the compute dtype and in
    the model's, their product; bf16 computed in float32: the attention's float32 K, V and scores too, measured 32
    bytes a hidden unit and token) and, streamed, every batch's hidden states, or (spilled to scratch when over half
    the memory left beside two layers) one batch's."""
    config, stored = text_config(plan.checkpoint.config), plan.dtype.itemsize if plan.dtype else 2
    hidden, longest = int(config.get("hidden_size") or 0), max(map(len, data.sequences))
    inner, emulated = int(config.get("intermediate_size") or 4 * hidden), plan.compute.emulated
    batch = plan.options.batch_size * longest
    held += batch * (inner * ((4 if emulated else stored) + 2 * stored) + 32 * hidden * emulated)
    table = int(config.get("vocab_size") or 0) * hidden * stored
    head = 0 if config.get("tie_word_embeddings") else table
    if plan.engine.engine != "stream":
        return held + weights - head, 0
    two_layers = 2 * max(weights - table - head, 0) // layers
    held, states = held + table + head + two_layers, len(data.sequences) * longest * hidden * stored
    if states > (available - two_layers) // 2:  # as the stream engine decides
        return held + batch * hidden * stored, states
    return held + states, 0
