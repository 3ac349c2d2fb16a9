"""calibrate: per-layer K/V absmax over a dataset -> FP8 scales -> a new checkpoint, validated, then published.

Cheap checks first (check_run), then the engine observes, the scale objective chooses, the writer publishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvcalib._version import __version__
from kvcalib.calibration.card import summarize, write_card
from kvcalib.calibration.distributed import observe_across_ranks
from kvcalib.calibration.engine import Engine, EngineInputs, Observation
from kvcalib.calibration.llmcompressor import llmcompressor_engine
from kvcalib.calibration.native import native_engine, sample_attention
from kvcalib.calibration.objective import (
    ABSMAX,
    Gather,
    Scored,
    absmax_warnings,
    scored_numerics,
    search,
)
from kvcalib.calibration.options import CalibrateOptions, CalibrationResult, LayerScales, Machine
from kvcalib.calibration.recipe import (
    LLMCOMPRESSOR_ENGINE,
    RecipePlan,
    plan_recipe,
    require_llmcompressor,
)
from kvcalib.calibration.scales import layer_scales, scale_tensors
from kvcalib.calibration.stream import stream_engine
from kvcalib.calibration.writer import WritePlan, check_output_path, check_room, write_checkpoint
from kvcalib.core import fp8, mxfp4
from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.cpu import NATIVE, ComputePath
from kvcalib.core.errors import UsageError, ValidationFailedError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.core.records import to_json
from kvcalib.core.schema import (
    ATTN_HEAD,
    SCALES_FILENAME,
    kv_cache_size,
    kv_only_quantization_config,
    max_position_embeddings,
)
from kvcalib.hf.data import CalibrationData, load_calibration_data
from kvcalib.hf.memory import EngineChoice, choose_engine, out_of_memory_error
from kvcalib.hf.model import (
    load_tokenizer,
    pad_id,
    prepare_run,
    resolve_compute,
    resolve_target,
)
from kvcalib.hf.samples import sample_sequences
from kvcalib.validation.pipeline import (
    validate_checkpoint,  # calibrate validates what it wrote (pyproject.toml)
)
from kvcalib.validation.report import ValidationReport

__all__ = [
    "ENGINES",
    "RunPlan",
    "calibrate",
    "check_run",
    "engine_inputs",
    "read_data",
]

# The engines by name. llm-compressor itself is imported only when its engine runs.
ENGINES: dict[str, Engine] = {
    "native": native_engine,
    "stream": stream_engine,
    "llmcompressor": llmcompressor_engine,
}


@dataclass(frozen=True)
class RunPlan:
    """The run as resolved from the options (as the user gave them) and the machine, checked before the long work
    starts: the engine chosen, the compute path, the recipe's strategy and Q scales, the provenance."""

    options: CalibrateOptions
    machine: Machine
    recipe: RecipePlan
    target: fp8.Target
    checkpoint: Checkpoint
    output: Path
    dtype: torch.dtype | None
    device: torch.device
    engine: EngineChoice
    compute: ComputePath
    attention_scales: bool  # asked, or the recipe's
    provenance: dict[str, Any]  # the recipe's, the engine's, extra_provenance
    inputs: tuple[tuple[str, Path], ...]  # what the output must not overlap
    recovered: tuple[str, ...]  # what was restored or removed from interrupted runs


def calibrate(
    model: str | Path,
    dataset: str,
    output: str | Path,
    options: CalibrateOptions | None = None,
    machine: Machine | None = None,
    progress: ProgressCallback | None = None,
) -> CalibrationResult:
    """Calibrate `model` on `dataset` and write the FP8-KV checkpoint to `output` (machine None: this one)."""
    notify = progress or no_progress
    started = time.perf_counter()
    plan = check_run(model, dataset, Path(output), options or CalibrateOptions(), machine)
    opts, ranks = plan.options, plan.machine.ranks

    notify(Progress("load-data"))
    data, pad = read_data(plan, dataset)
    inputs = engine_inputs(plan, data, pad, notify)
    observation, choices, objective_seconds = _observe(plan, inputs)

    layers, warnings = layer_scales(
        observation,
        plan.target,
        plan.checkpoint.root,
        plan.recipe.strategy == ATTN_HEAD,
        plan.attention_scales,
        choices,
        opts.headroom,
    )
    if choices is not None:
        warnings.extend(absmax_warnings(layers, observation.samples, plan.target))
    if plan.engine.reason:
        warnings.append(plan.engine.reason)
    context = max_position_embeddings(plan.checkpoint.config)
    if context is not None and 2 * data.longest < context and opts.headroom == 1.0:
        warnings.append(  # samples under half the served context (SmolLM2 at 8k tokens: K absmax 1.18x)
            f"calibration samples are at most {data.longest} tokens (--max-seq-len {opts.max_seq_len}), the model "
            f"serves up to {context}: K/V later in long prompts can exceed the absmax seen here and saturate. Measure "
            f"it with `kvcalib eval-context {output} --dataset HELD_OUT --lengths {min(context, 8192)}`; calibrate "
            "with --headroom 1.4142 (room for the growth), or on longer samples (--max-seq-len)"
        )

    validation = None
    if ranks is not None and not ranks.is_writer:  # rank 0 writes and validates
        warnings.append(f"rank {ranks.rank}: nothing written (rank 0 writes)")
    else:
        notify(Progress("write"))
        notes, validation = _write(
            plan, data, layers, observation.attention_classes if plan.attention_scales else ()
        )
        warnings = [*plan.recovered, *plan.recipe.warnings, *warnings, *notes]
    return CalibrationResult(
        output=str(output),
        model=str(model),
        target=plan.target.name,
        fp8_max=plan.target.fp8_max,
        num_samples=len(data.sequences),
        num_tokens=data.num_tokens,
        layers=tuple(layers),
        seconds=time.perf_counter() - started,
        observe_seconds=observation.seconds,
        warnings=tuple(warnings),
        validation=validation,
        compute=plan.compute.describe(),
        scale_objective=opts.scale_objective,
        objective_seconds=objective_seconds,
        kv_cache=kv_cache_size(plan.checkpoint.config),
        token_budget=opts.token_budget(data),
    )


def read_data(plan: RunPlan, dataset: str) -> tuple[CalibrationData, int]:
    """The calibration samples, tokenised as the run tokenises them, and the padding id."""
    opts = plan.options
    tokenizer = load_tokenizer(plan.checkpoint.root, opts.trust_remote_code)
    data = load_calibration_data(dataset, tokenizer, opts)
    return data, pad_id(tokenizer)


def engine_inputs(
    plan: RunPlan,
    data: CalibrationData,
    pad: int,
    notify: ProgressCallback,
    probe_layers: int | None = None,
) -> EngineInputs:
    """What the engine gets for `data`: the scale objective's sequences among them, the memory limit it sizes by."""
    opts = plan.options
    sampled = (
        sample_sequences(data.sequences, opts.batch_size)
        if opts.scale_objective != ABSMAX
        else frozenset()
    )
    return EngineInputs(
        plan.checkpoint,
        data,
        opts,
        plan.machine,
        plan.attention_scales,
        plan.dtype,
        plan.device,
        pad,
        notify,
        plan.compute,
        plan.engine.limit or plan.machine.memory,
        sampled,
        probe_layers,
    )


def check_run(
    model: str | Path,
    dataset: str,
    output: Path,
    opts: CalibrateOptions,
    machine: Machine | None = None,
    *,
    dry: bool = False,
) -> RunPlan:
    """The cheap checks, before any weight is loaded; the run resolved from `opts` and `machine` (None: this one,
    read). `dry`: leave leftovers as they are."""
    opts.check_arguments()
    machine = machine or Machine.read(opts)
    recipe = plan_recipe(opts.recipe, opts.target, opts.engine, opts.strategy)  # checked together
    target = resolve_target(recipe.target)
    attention_scales = opts.attention_scales or recipe.attention_scales
    provenance = {**recipe.provenance, **opts.extra_provenance}
    if opts.engine == LLMCOMPRESSOR_ENGINE:
        if attention_scales:  # said before whether it is installed
            raise UsageError(
                "--attention-scales observes Q with kvcalib's own engines; --engine llmcompressor "
                "observes K/V only",
                hint="drop --engine llmcompressor (native or stream observe Q)",
            )
        provenance["llmcompressor_version"] = require_llmcompressor()
    run = prepare_run(model, opts)
    checkpoint, dtype, device = run.checkpoint, run.dtype, run.device
    provenance.update(mxfp4.check_calibration(checkpoint, target, opts.engine))
    inputs = [
        ("the model checkpoint", checkpoint.root),
        ("the dataset", Path(dataset).expanduser()),
    ]
    if opts.recipe is not None:
        inputs.append(("the recipe", Path(opts.recipe)))
    ranks = machine.ranks
    writer = (
        ranks is None or ranks.is_writer
    )  # under torchrun only rank 0 touches the output's parent
    recovered = check_output_path(
        output, inputs, opts.overwrite, recover_leftovers=writer and not dry
    )
    if writer:
        check_room(output, checkpoint)
    if (
        ranks is not None and device.type == "cuda" and device.index is None
    ):  # cuda: this rank's own GPU
        if ranks.local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"rank {ranks.rank} (local rank {ranks.local_rank}) has no GPU: torch sees "
                f"{torch.cuda.device_count()}",
                hint="run at most one process per GPU (torchrun --nproc-per-node <number of GPUs>)",
            )
        device = torch.device("cuda", ranks.local_rank)
    copies = ranks.local_world_size if ranks else 1
    choice = choose_engine(opts.engine, checkpoint, dtype, device, copies, machine.memory)
    compute = (  # oneshot runs the model as its users run it
        ComputePath(NATIVE, "llm-compressor's oneshot runs the model natively")
        if choice.engine == LLMCOMPRESSOR_ENGINE
        else resolve_compute(opts.bf16_compute, dtype, checkpoint, device, machine.cpu)
    )
    return RunPlan(
        opts,
        machine,
        recipe,
        target,
        checkpoint,
        output,
        dtype,
        device,
        choice,
        compute,
        attention_scales,
        provenance,
        tuple(inputs),
        tuple(recovered),
    )


def _observe(
    plan: RunPlan, inputs: EngineInputs
) -> tuple[Observation, list[tuple[Scored, Scored]] | None, float]:
    """The engine's observation, the scale objective's picks (None: absmax) and the seconds the search took."""
    engine, ranks = ENGINES[plan.engine.engine], plan.machine.ranks

    def finish(observation: Observation, gather: Gather) -> tuple[Any, float]:
        if not inputs.sample_sequences:
            return None, 0.0
        inputs.notify(Progress("objective"))
        started = time.perf_counter()
        samples = observation.samples
        if (
            not samples
        ):  # an engine that keeps none (llm-compressor's): rank 0 takes them in a pass of its own
            samples = (
                sample_attention(inputs)
                if ranks is None or ranks.rank == 0
                else tuple(() for _ in observation.k_heads)
            )
        scored = search(
            samples,
            observation.k_heads,
            observation.v_heads,
            plan.target,
            plan.recipe.strategy == ATTN_HEAD,
            gather,
        )
        return scored, time.perf_counter() - started

    try:
        if ranks is not None and ranks.world_size > 1:
            observation, (choices, seconds) = observe_across_ranks(engine, inputs, ranks, finish)
        else:
            observation = engine(inputs)
            choices, seconds = finish(observation, lambda local: local)
    except (MemoryError, RuntimeError) as exc:
        error = out_of_memory_error(exc, plan.engine.engine, plan.device)
        if error is None:
            raise
        raise error from exc
    return observation, choices, seconds


def _write(
    plan: RunPlan,
    data: CalibrationData,
    layers: list[LayerScales],
    attention_classes: tuple[str, ...],
) -> tuple[list[str], ValidationReport | None]:
    """Write, validate and publish the checkpoint; (notes, the validation report, naming the output)."""
    opts, target, config = plan.options, plan.target, plan.checkpoint.config
    provenance = {
        "tool": "kvcalib",
        "kvcalib_version": __version__,
        "scale_convention": "x = fp8 * scale; scale = range / fp8_max, rounded up so the chip never saturates "
        "range; range = absmax, or with the attention objective the clip it chose "
        "(layers[].k.range)",
        "scale_objective": opts.scale_objective,
        "headroom": opts.headroom,
        "target": target.name,
        "fp8_max": target.fp8_max,
        # the numerics the scale objective scored every candidate on (a clip is chosen only if good on all)
        "scored_on": [
            chip.name for chip in scored_numerics(target, plan.recipe.strategy == ATTN_HEAD)
        ]
        if opts.scale_objective != ABSMAX
        else [],
        "scales_file": SCALES_FILENAME,
        "model": str(plan.checkpoint.root),
        "dtype": str(plan.dtype).removeprefix("torch.")
        if plan.dtype
        else str(config.get("dtype") or config.get("torch_dtype")),
        "engine": plan.engine.engine,
        "dataset": data.source,
        "split": data.split,
        "column": data.column,
        "seed": opts.seed,
        "max_seq_len": opts.max_seq_len,
        "longest_sample": data.longest,
        "model_context": max_position_embeddings(config),
        "num_samples": len(data.sequences),
        "num_rows_selected": data.rows_selected,
        "num_rows_empty": data.rows_empty,
        "special_tokens": data.special_tokens_rule,
        "special_tokens_added": list(
            data.special_tokens
        ),  # e.g. [BOS]: what plain-text rows start with
        "num_tokens": data.num_tokens,
        "token_budget": opts.token_budget(data),
        "observer": "static_minmax",
        "strategy": plan.recipe.strategy,
        "attention_scales": plan.attention_scales,
        "layers": to_json(layers, drop=frozenset({"key"})),  # no tensor names
        **plan.provenance,
        "compute": plan.compute.describe(),
    }
    # the hub id the model came from, when config.json names one (a local path is no base_model)
    name = config.get("_name_or_path")
    hub_id = isinstance(name, str) and name.count("/") == 1 and not name.startswith((".", "/", "~"))
    validation: list[ValidationReport] = []

    def check(tmp_dir: Path) -> None:
        report = validate_checkpoint(tmp_dir, target.name)
        validation.append(replace(report, checkpoint=str(plan.output)))
        if not report.ok:
            first = report.errors[0]
            raise ValidationFailedError(
                f"the checkpoint kvcalib wrote fails validation ({len(report.errors)} "
                f"error(s)); first: [{first.rule}] {first.message}",
                hint="nothing was written; please report this as a kvcalib bug",
            )
        # validate's verdict, published too
        write_card(tmp_dir, summarize(report), base_model=name if hub_id else None)

    quantization = kv_only_quantization_config(plan.recipe.strategy, attention_classes)
    notes = write_checkpoint(
        plan.checkpoint,
        plan.output,
        WritePlan(scale_tensors(layers), quantization, provenance),
        overwrite=opts.overwrite,
        check=check,
        inputs=plan.inputs,
    )
    return notes, validation[0] if validation else None
