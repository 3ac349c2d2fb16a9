"""`kvcalib serve-check`: serve a checkpoint with vLLM's FP8 KV cache and prove it answers sensibly.

Pre-flight (validate, device, vLLM) before any server; then a baseline server without FP8 KV (default on cpu), the
FP8 server, and the verdict: mean top-1 agreement with the baseline >= AGREEMENT_THRESHOLD, FP8 NLL <= baseline NLL
x (1 + NLL_TOLERANCE), no output degenerate where the baseline's is not, the --context passkey answered wherever the
baseline answers it. Without a baseline (Neuron's default) a degenerate output fails on its own. Command lines follow
the plugin's own (vllm-neuron test/utils/server/); every server is a `VllmServer` context, stopped on every path."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.core.checkpoint import Checkpoint, read_config
from kvcalib.core.errors import ServerError, UsageError
from kvcalib.core.paths import overlapping
from kvcalib.serving.canary import (
    CANARY_DIVISOR,
    CanaryResult,
    judge_canary,
    make_variant,
    mean_agreement,
    self_agreement,
)
from kvcalib.serving.launch import (
    baseline_kv_dtype,
    command_line,
    cpu_kv_cache_bytes,
    interpreter_path,
    server_argv,
    server_env,
)
from kvcalib.serving.options import NEURON_DEVICES, ServeOptions
from kvcalib.serving.predict import DeltaIntervals, Prediction, delta_intervals, predict
from kvcalib.serving.preflight import Environment, Preflight, check_environment, preflight
from kvcalib.serving.probe import Completion, ServerClient, degenerate
from kvcalib.serving.prompts import (
    BUILTIN_PROMPTS,
    NLL_TEXT,
    Prompt,
    contains,
    context_prompt,
    unjudged_passkeys,
)
from kvcalib.serving.server import (
    KvCapacity,
    VllmServer,
    free_port,
    kv_capacity,
    require_free_port,
)

if TYPE_CHECKING:
    from kvcalib.evaluation.tasks import LmEvalOutput
    from kvcalib.serving.tasks import ServedTaskRow

__all__ = [
    "AGREEMENT_THRESHOLD",
    "NLL_TOLERANCE",
    "check_serving",
    "Progress",
    "PromptResult",
    "ServeCheckResult",
    "ServeEvent",
    "ServeOptions",
    "ServerRun",
    "judge",
    "serve_check",
]

# Where the server's numerics differ from its validate target's: vLLM CPU truncates to E4M3 (core.fp8.EMULATED).
EMULATED_DEVICES = {"cpu": "vllm-cpu"}
AGREEMENT_THRESHOLD = 0.8  # mean top-1 agreement with the baseline, over the prompts
NLL_TOLERANCE = 0.10  # FP8 NLL may exceed the baseline's by at most 10 %


@dataclass(frozen=True)
class ServeEvent:
    """Progress: stage is launch (message: the command), wait, ready, probe, stop or stopped."""

    stage: str
    server: str  # "fp8" or "baseline"
    elapsed_s: float = 0.0
    message: str = ""


@dataclass(frozen=True)
class PromptResult:
    """One prompt in ServeCheckResult's prompts: prompt, output, baseline_output, agreement (share of the baseline's
    tokens the FP8 server ranks first), expected, expected_found, problem (why the output is degenerate),
    baseline_problem (the baseline's: then the FP8 one's is no failure), failed, label (--context's passkey)."""

    prompt: str
    output: str
    baseline_output: str | None
    agreement: float | None
    expected: str | None = None
    problem: str | None = None
    baseline_problem: str | None = None
    label: str | None = None

    @property
    def failed(self) -> bool:
        """Degenerate where the baseline is not (or with no baseline to compare)."""
        return self.problem is not None and self.baseline_problem is None

    JSON = {
        "expected_found": lambda p: None if p.expected is None else contains(p.output, p.expected),
        "failed": "failed",
    }


@dataclass(frozen=True)
class ServerRun:
    """What one server did: how long it took to be healthy, and what it answered."""

    command: str
    log: str
    ready_s: float
    completions: tuple[Completion, ...]
    nll: float
    agreements: tuple[float | None, ...] | None = None
    task_output: LmEvalOutput | None = (
        None  # serve-check --tasks: lm-eval's output against this server
    )
    pid: int | None = None  # the server's process id: it leads its own session and process group
    token_nll: tuple[float, ...] = ()  # each token's NLL of the fixed text (nll is their mean)
    kv_capacity: KvCapacity = KvCapacity()  # the KV cache vLLM logged


@dataclass(frozen=True)
class ServeCheckResult:
    """What `serve-check` found; to_json() is its --json: checkpoint, device, ok, failures, warnings, ready_s, command,
    log (the FP8 server's), baseline_ready_s, baseline_command, baseline_log (null: no baseline), prompts
    (PromptResult), nll (fp8, baseline: nats per token of the fixed text), agreement, thresholds, fp8_max,
    tensor_parallel_size, vllm; null unless run: canary (CanaryResult), unit (every scale 1.0), prediction (eval's);
    delta_nll (served, predicted, intervals: DeltaIntervals), variants, server_pids, tasks (--tasks: ServedTaskRow),
    kv_capacity (KvCapacity per server, from vLLM's log)."""

    checkpoint: str
    device: str
    ok: bool
    ready_s: float
    command: str
    log: str
    prompts: tuple[PromptResult, ...]
    nll_fp8: float
    nll_baseline: float | None
    agreement: float | None
    failures: tuple[str, ...]
    warnings: tuple[str, ...]
    fp8_max: float | None
    tensor_parallel_size: int
    vllm_version: str
    baseline_ready_s: float | None = None
    baseline_command: str | None = None
    baseline_log: str | None = None
    canary: CanaryResult | None = None
    unit: ServerRun | None = None
    prediction: Prediction | None = None
    server_pids: Mapping[str, int] = field(default_factory=dict)
    tasks: tuple[ServedTaskRow, ...] = ()
    intervals: DeltaIntervals = DeltaIntervals()
    kv_capacity: Mapping[str, KvCapacity] = field(default_factory=dict)

    def variants(self) -> list[dict[str, Any]]:
        """The table: each server's NLL and agreement, served and predicted ΔNLL."""
        rows = []
        if self.nll_baseline is not None:
            rows.append(
                {
                    "name": "baseline",
                    "nll": self.nll_baseline,
                    "agreement": None,
                    "served_delta_nll": 0.0,
                    "predicted_delta_nll": 0.0 if self.prediction else None,
                }
            )
        pred = self.prediction
        rows.append(
            self._row("calibrated", self.nll_fp8, self.agreement, pred.delta_nll if pred else None)
        )
        if self.unit is not None:
            rows.append(
                self._row(
                    "scales 1.0",
                    self.unit.nll,
                    mean_agreement(self.unit.agreements),
                    pred.unit_delta_nll if pred else None,
                )
            )
        if self.canary is not None:
            rows.append(
                self._row(
                    f"scales x{self.canary.factor:g}",
                    self.canary.nll,
                    self.canary.agreement,
                    pred.canary_delta_nll if pred else None,
                )
            )
        return rows

    def _row(
        self, name: str, nll: float, agreement: float | None, predicted: float | None
    ) -> dict[str, Any]:
        served = None if self.nll_baseline is None else nll - self.nll_baseline
        return {
            "name": name,
            "nll": nll,
            "agreement": agreement,
            "served_delta_nll": served,
            "predicted_delta_nll": predicted,
        }

    JSON = {
        "nll_fp8": None,
        "nll_baseline": None,
        "vllm_version": None,
        "intervals": None,
        "vllm": "vllm_version",
        "nll": lambda r: {"fp8": r.nll_fp8, "baseline": r.nll_baseline},
        "thresholds": lambda _: {"agreement": AGREEMENT_THRESHOLD, "nll_tolerance": NLL_TOLERANCE},
        "unit": lambda r: (
            r.unit and {"nll": r.unit.nll, "agreement": mean_agreement(r.unit.agreements)}
        ),
        "delta_nll": lambda r: {
            "served": None if r.nll_baseline is None else r.nll_fp8 - r.nll_baseline,
            "predicted": r.prediction and r.prediction.delta_nll,
            "intervals": r.intervals,
        },
        "variants": lambda r: r.variants(),
    }


Progress = Callable[[ServeEvent], None]


def _run_server(
    name: str,
    checkpoint: Path,
    options: ServeOptions,
    pre: Preflight,
    log_dir: Path,
    prompts: Sequence[Prompt],
    reference: Sequence[Completion] | None,
    progress: Progress,
) -> ServerRun:
    port = options.port or free_port()
    if options.port:
        require_free_port(port)
    kv_bytes = (
        cpu_kv_cache_bytes(pre.config, options.max_model_len, options.max_num_seqs)
        if options.device == "cpu"
        else None
    )
    argv = server_argv(
        options.vllm_python,
        checkpoint,
        port,
        fp8=(name != "baseline"),
        device=options.device,
        tp=pre.tensor_parallel_size,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        kv_cache_bytes=kv_bytes,
        baseline_dtype=baseline_kv_dtype(pre.config),
        neuron_quantization=pre.neuron_quantization,
    )
    env, added = server_env(options.env, log_dir / "cache", options.neuron_visible_devices)
    command, log_path = command_line(argv, added), log_dir / f"vllm-{name}.log"
    progress(ServeEvent("launch", name, message=command))
    server = VllmServer(
        name, argv, env, port, log_path, cwd=log_dir, stop_timeout_s=options.stop_timeout_s
    )
    try:
        with server:
            ready_s = server.wait_healthy(
                options.startup_timeout_s,
                lambda tick: progress(
                    ServeEvent("wait", tick.name, tick.elapsed_s, tick.last_log_line)
                ),
            )
            progress(ServeEvent("ready", name, ready_s))
            run = _probe(name, server, checkpoint, options, prompts, reference, progress)
            progress(ServeEvent("stop", name))
    finally:
        progress(ServeEvent("stopped", name))
    *answers, token_nll = run
    return ServerRun(
        command,
        str(log_path),
        ready_s,
        *answers,
        pid=server.pid,
        token_nll=token_nll,
        kv_capacity=kv_capacity(log_path.read_text(encoding="utf-8", errors="replace")),
    )


def _probe(
    name: str,
    server: VllmServer,
    checkpoint: Path,
    options: ServeOptions,
    prompts: Sequence[Prompt],
    reference: Sequence[Completion] | None,
    progress: Progress,
) -> tuple[Any, ...]:
    client = ServerClient(server.url, str(checkpoint), server.exit_code, log=str(server.log_path))
    try:
        completions = []
        for i, prompt in enumerate(prompts, start=1):
            progress(ServeEvent("probe", name, message=f"prompt {i}/{len(prompts)}"))
            completions.append(client.complete(prompt.text, options.max_tokens))
        progress(ServeEvent("probe", name, message="NLL of the fixed text"))
        token_nll = client.token_nlls(NLL_TEXT)
        agreements = None
        if reference is not None:
            progress(ServeEvent("probe", name, message="agreement with the baseline"))
            agreements = tuple(
                client.top1_agreement(ref.prompt_token_ids, ref.token_ids) for ref in reference
            )
        task_output = None
        if options.tasks is not None and name in ("baseline", "fp8"):
            progress(
                ServeEvent("probe", name, message=f"lm-eval tasks {','.join(options.tasks.tasks)}")
            )
            from kvcalib.serving.tasks import run_served_tasks

            task_output = run_served_tasks(server.url, checkpoint, options.tasks)
    except ServerError:
        if server.exit_code() is not None:  # it died: show why, as for a failed start
            raise server.failure(
                f"the {name} vLLM server exited with code {server.exit_code()} during the probe"
            ) from None
        raise
    return tuple(completions), sum(token_nll) / len(token_nll), agreements, task_output, token_nll


def judge(
    prompts: Sequence[Prompt], fp8: ServerRun, baseline: ServerRun | None
) -> tuple[list[PromptResult], list[str], float | None]:
    """Per-prompt results, the reasons the check failed (none: it passed), and the mean agreement."""
    results, failures = [], []
    for i, (prompt, out) in enumerate(zip(prompts, fp8.completions)):
        reference = baseline.completions[i] if baseline else None
        tokens = prompt.tokens or len(out.prompt_token_ids)
        result = PromptResult(
            prompt.text,
            out.text,
            reference.text if reference else None,
            fp8.agreements[i] if fp8.agreements else None,
            prompt.expected,
            degenerate(out.text, out.token_ids),
            degenerate(reference.text, reference.token_ids) if reference else None,
            f"passkey prompt, {tokens:,} tokens, key {prompt.expected}"
            if prompt.required
            else None,
        )
        if result.failed:
            against = ", where the baseline's is not" if reference else ""
            failures.append(
                f"prompt {i + 1} ({prompt.text[:40]!r}): degenerate output, {result.problem}{against}"
            )
        elif (
            prompt.required
            and reference
            and contains(reference.text, prompt.expected)
            and not contains(out.text, prompt.expected)
        ):
            failures.append(
                f"prompt {i + 1} (the {tokens:,}-token passkey): the "
                f"baseline answers the key {prompt.expected}, the FP8 server does not ({out.text[:40]!r})"
            )
        results.append(result)
    agreement = None
    if baseline is not None and fp8.agreements is not None:
        agreement = mean_agreement(fp8.agreements)
        if agreement is not None and agreement < AGREEMENT_THRESHOLD:
            failures.append(
                f"mean agreement with the baseline {agreement:.2f} < {AGREEMENT_THRESHOLD}"
            )
        if fp8.nll > baseline.nll * (1 + NLL_TOLERANCE):
            failures.append(
                f"FP8 NLL {fp8.nll:.3f} > baseline {baseline.nll:.3f} x {1 + NLL_TOLERANCE:g}"
            )
    return results, failures, agreement


def _checked(options: ServeOptions, checkpoint: Path) -> ServeOptions:
    """The arguments, then the options with --vllm-python made absolute."""
    options.check_arguments()
    if options.log_dir is not None and overlapping(options.log_dir, checkpoint):
        raise UsageError(
            f"--log-dir {options.log_dir} overlaps the checkpoint {checkpoint}",
            hint="kvcalib never writes into the checkpoint it checks; put the logs elsewhere",
        )
    options = replace(
        options, vllm_python=interpreter_path(options.vllm_python, options.env.get("PATH"))
    )
    if not options.vllm_python.exists():
        raise UsageError(
            f"--vllm-python {options.vllm_python}: no such file",
            hint="pass the python of the "
            "environment that has vLLM (for CPU: bash scripts/setup_vllm_cpu.sh prints it)",
        )
    return options


def check_serving(model: Path, options: ServeOptions) -> Environment:
    """What `calibrate --serve-check` checks first: all serve-check would refuse but the scales (not there yet)."""
    model = Path(model).resolve()
    options = _checked(options, model)
    return check_environment(read_config(model), options)


def serve_check(
    checkpoint: Path, options: ServeOptions, progress: Progress | None = None
) -> ServeCheckResult:
    """Run the whole check; raises KvcalibError when it cannot run, returns ok=False when it ran and failed."""
    emit, checkpoint = progress or (lambda event: None), Path(checkpoint).resolve()
    options = _checked(options, checkpoint)
    pre = preflight(checkpoint, options)
    prompts = (
        *(options.prompts or BUILTIN_PROMPTS),
        *((context_prompt(checkpoint, pre.config, options.context),) if options.context else ()),
    )
    # absolute: every server runs in the log directory, and the variants and caches under it are passed by path
    log_dir = (
        Path(options.log_dir).absolute()
        if options.log_dir
        else Path(tempfile.mkdtemp(prefix="kvcalib-serve-"))
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    with_baseline = (
        options.baseline if options.baseline is not None else options.device not in NEURON_DEVICES
    )
    with_canary = (
        options.canary if options.canary is not None else options.device not in NEURON_DEVICES
    )
    if options.tasks is not None:
        from kvcalib.serving.tasks import check_tasks

        check_tasks(
            options.tasks, with_baseline
        )  # a baseline, lm-eval, the tasks and their data: before any server
    warnings = list(pre.warnings)
    if not with_canary:
        warnings.append(
            "the canary is off (on Neuron each variant is another compile): nothing proves the server "
            "applies the checkpoint's scales; pass --canary to check"
        )
    canary_dir = (
        make_variant(
            checkpoint,
            log_dir / "variants" / f"scales-div{CANARY_DIVISOR:g}",
            factor=1 / CANARY_DIVISOR,
        )
        if with_canary
        else None
    )
    prediction = _predict(checkpoint, options, pre, canary_dir, warnings)
    baseline = (
        _run_server("baseline", checkpoint, options, pre, log_dir, prompts, None, emit)
        if with_baseline
        else None
    )
    fp8 = _run_server(
        "fp8",
        checkpoint,
        options,
        pre,
        log_dir,
        prompts,
        baseline.completions if baseline else None,
        emit,
    )
    results, failures, agreement = judge(prompts, fp8, baseline)
    warnings += unjudged_passkeys(prompts, results)
    intervals = delta_intervals(
        baseline.token_nll if baseline else None, fp8.token_nll, prediction, warnings
    )
    tasks = _task_rows(options, checkpoint, pre, baseline, fp8)
    canary, unit, canary_run = None, None, None
    if canary_dir is not None:
        reference = (baseline or fp8).completions
        if options.device == "cpu":  # cheap here: the table shows calibrated vs 1.0 vs broken
            unit_dir = make_variant(checkpoint, log_dir / "variants" / "scales-1.0", value=1.0)
            unit = _run_server("unit", unit_dir, options, pre, log_dir, prompts, reference, emit)
        canary_run = _run_server(
            "canary", canary_dir, options, pre, log_dir, prompts, reference, emit
        )
        canary = judge_canary(
            fp8 if baseline else self_agreement(fp8),
            canary_run,
            1 / CANARY_DIVISOR,
            options.device,
            pre.vllm_version,
        )
        if not canary.ok:
            failures.append(canary.reason)
    return ServeCheckResult(
        checkpoint=str(checkpoint),
        device=options.device,
        ok=not failures,
        ready_s=fp8.ready_s,
        command=fp8.command,
        log=fp8.log,
        prompts=tuple(results),
        nll_fp8=fp8.nll,
        nll_baseline=baseline.nll if baseline else None,
        agreement=agreement,
        failures=tuple(failures),
        warnings=tuple(warnings),
        fp8_max=pre.fp8_max,
        tensor_parallel_size=pre.tensor_parallel_size,
        vllm_version=pre.vllm_version,
        baseline_ready_s=baseline.ready_s if baseline else None,
        baseline_command=baseline.command if baseline else None,
        baseline_log=baseline.log if baseline else None,
        canary=canary,
        unit=unit,
        prediction=prediction,
        tasks=tuple(tasks),
        intervals=intervals,
        server_pids={
            name: r.pid
            for name, r in (
                ("baseline", baseline),
                ("fp8", fp8),
                ("unit", unit),
                ("canary", canary_run),
            )
            if r is not None and r.pid is not None
        },
        kv_capacity={
            name: r.kv_capacity
            for name, r in (("baseline", baseline), ("fp8", fp8))
            if r is not None
        },
    )


def _task_rows(
    options: ServeOptions,
    checkpoint: Path,
    pre: Preflight,
    baseline: ServerRun | None,
    fp8: ServerRun,
) -> list[ServedTaskRow]:
    """serve-check --tasks: the FP8 server's task scores paired with the baseline's, next to kvcalib's prediction."""
    if options.tasks is None or baseline is None:
        return []
    from kvcalib.serving.tasks import served_rows

    numerics = EMULATED_DEVICES.get(options.device, pre.target) if options.predict else None
    return served_rows(options.tasks, baseline.task_output, fp8.task_output, checkpoint, numerics)


def _predict(
    checkpoint: Path,
    options: ServeOptions,
    pre: Preflight,
    canary_dir: Path | None,
    warnings: list[str],
) -> Prediction | None:
    """kvcalib's emulation of the same text, in-process on CPU; None (with a warning) when skipped."""
    if not options.predict:
        return None
    weights = Checkpoint.open(checkpoint).weight_bytes(
        4
    )  # the emulation runs the model in float32 at worst
    if options.memory_bytes is not None and weights > options.memory_bytes // 2:
        warnings.append(
            f"no prediction: the model needs about {weights / 2**30:.1f} GiB in float32, more than half "
            f"of the {options.memory_bytes / 2**30:.1f} GiB this host has free"
        )
        return None
    numerics = EMULATED_DEVICES.get(options.device, pre.target)
    return predict(
        checkpoint,
        numerics,
        NLL_TEXT,
        canary=canary_dir,
        unit=options.device == "cpu",
        cpu=options.cpu,
    )
