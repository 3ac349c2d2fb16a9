"""serve-check --tasks: lm-eval tasks against the live servers (lm-eval's "local-completions" model), the FP8
server's per-item scores paired with the baseline's, next to kvcalib's emulation on the same items."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kvcalib.core.errors import UsageError
from kvcalib.core.records import to_json
from kvcalib.evaluation.significance import Interval
from kvcalib.evaluation.tasks import (
    BASELINE_NAME,
    LmEvalOutput,
    TaskOptions,
    TaskRow,
    check_data,
    evaluate_tasks,
    paired_rows,
    require_lm_eval,
    run_lm_eval,
    task_manager,
)

__all__ = [
    "ServedTaskRow",
    "TaskScores",
    "TaskSpec",
    "check_tasks",
    "run_served_tasks",
    "served_rows",
]

FP8_NAME = "fp8"


@dataclass(frozen=True)
class TaskSpec(TaskOptions):
    """What serve-check --tasks runs: eval-tasks' options (lm-eval task names, items per task, where their data
    comes from)."""

    @classmethod
    def from_flags(
        cls, tasks: str | None, limit: int | None, task_data: str | None
    ) -> TaskSpec | None:
        """serve-check's --tasks, --limit, --task-data (None without --tasks)."""
        if tasks is None:
            if limit is not None or task_data is not None:
                raise UsageError(
                    "--limit and --task-data go with --tasks", hint="pass --tasks TASK[,TASK]"
                )
            return None
        return cls(
            tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()),
            limit=limit,
            task_data=task_data,
        )


@dataclass(frozen=True)
class TaskScores:
    """The served or the predicted scores in a ServedTaskRow: baseline, fp8, interval (fp8 - baseline on the same
    items; null: none, the verdict says why), verdict."""

    baseline: float
    fp8: float
    interval: Interval | None
    verdict: str

    @classmethod
    def of(cls, row: TaskRow, name: str) -> TaskScores:
        """Run `name`'s scores in an eval row, against the row's baseline."""
        return cls(row.baseline, row.scores[name], row.intervals.get(name), row.verdict(name))


@dataclass(frozen=True)
class ServedTaskRow:
    """One task and metric in ServeCheckResult's tasks: task, metric, filter, items; served (TaskScores of the FP8
    server against the baseline server); predicted (kvcalib's emulation of both on the same items, with its numerics;
    null: not predicted)."""

    task: str
    metric: str
    filter: str
    items: int
    served: TaskScores
    predicted: TaskScores | None = None
    numerics: str | None = None

    JSON = {
        "numerics": None,
        "predicted": lambda row: (
            row.predicted and {"numerics": row.numerics, **to_json(row.predicted)}
        ),
    }


def check_tasks(spec: TaskSpec, with_baseline: bool = True) -> None:
    """Before any server starts: a baseline server to pair with, lm-eval installed, the tasks known, their data
    readable, the numbers sane."""
    if not with_baseline:
        raise UsageError(
            "--tasks pairs the FP8 server's scores with the baseline server's, which is off",
            hint="pass --baseline (on Neuron a second compile), or leave out --tasks",
        )
    spec.check_arguments()
    require_lm_eval()
    try:  # lm-eval's API models need its [api] extra
        import aiohttp  # noqa: F401
        import tenacity  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"serve-check --tasks needs lm-eval's API models, which need {exc.name}",
            hint="pip install 'kvcalib[tasks]' (it brings lm-eval[api])",
        ) from None
    check_data(task_manager(spec), spec)


def run_served_tasks(url: str, checkpoint: Path, spec: TaskSpec) -> LmEvalOutput:
    """The tasks against the server at `url`, through lm-eval's local-completions model (token ids sent as lm-eval
    tokenises them with the checkpoint's tokenizer, one request at a time)."""
    return run_lm_eval(
        "local-completions",
        spec,
        task_manager(spec),
        model_args={
            "model": str(checkpoint),
            "base_url": f"{url}/v1/completions",
            "tokenizer": str(checkpoint),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 2,
        },
    )


def served_rows(
    spec: TaskSpec,
    baseline: LmEvalOutput,
    fp8: LmEvalOutput,
    checkpoint: Path,
    numerics: str | None,
) -> list[ServedTaskRow]:
    """Per task and metric: the served baseline and FP8 scores with the paired interval, and kvcalib's prediction
    of both on the same items (numerics None: no prediction)."""
    predicted = {}
    if numerics is not None:
        result = evaluate_tasks(str(checkpoint), replace(spec, target=numerics))
        predicted = {(r.task, r.metric, r.filter): r for r in result.rows}
    rows = []
    for task in spec.tasks:
        for row in paired_rows(task, {BASELINE_NAME: baseline, FP8_NAME: fp8}):
            guess = predicted.get((row.task, row.metric, row.filter))
            rows.append(
                ServedTaskRow(
                    row.task,
                    row.metric,
                    row.filter,
                    row.items,
                    TaskScores.of(row, FP8_NAME),
                    guess and TaskScores.of(guess, "checkpoint"),
                    guess and numerics,
                )
            )
    return rows
