"""eval-tasks: lm-eval-harness tasks under the target chip's FP8 KV numerics, paired against the baseline.

lm-eval runs the same items for the unquantised baseline and every scale set, through harness.KvcalibLM (one model
in memory). Per task and metric: each run's score and, for a mean over items (acc, exact_match, ...), a paired
bootstrap interval of the difference from the baseline; a metric aggregated otherwise (perplexity, corpus BLEU) is
reported without an interval, never with a made-up one."""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.core.errors import UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.evaluation.options import TaskOptions
from kvcalib.evaluation.significance import Interval, paired_bootstrap

__all__ = [
    "BASELINE_NAME",
    "TaskOptions",
    "TaskResult",
    "TaskRow",
    "check_data",
    "evaluate_tasks",
    "LmEvalOutput",
    "paired_rows",
    "require_lm_eval",
    "run_lm_eval",
    "task_manager",
]

BASELINE_NAME = "baseline"
LmEvalOutput = dict[str, Any]
"""lm-eval's simple_evaluate output with log_samples: its "samples", "results" and "configs", as lm-eval writes them."""


@dataclass(frozen=True)
class TaskRow:
    """One task, metric and filter in TaskResult's rows: task, metric, filter, items, higher_is_better, baseline,
    scores, intervals and verdicts (per scale set; a null interval: no_interval_reason says why)."""

    task: str
    metric: str
    filter: str
    items: int
    higher_is_better: bool
    baseline: float
    scores: dict[str, float]
    intervals: dict[str, Interval | None]
    no_interval_reason: str = ""

    def verdict(self, name: str, cell: bool = False) -> str:
        """The interval's verdict (Interval.verdict; `cell`: for a table), or why there is none."""
        interval = self.intervals.get(name)
        if interval is None:
            return (
                f"no paired interval: {self.no_interval_reason}"
                if self.no_interval_reason
                else "no interval"
            )
        return interval.verdict(cell=cell)

    JSON = {"verdicts": lambda row: {n: row.verdict(n) for n in row.scores}}


@dataclass(frozen=True)
class TaskResult:
    """What `eval-tasks` scored; to_json() is its --json: checkpoint, target, tasks, runs (the scale sets), limit,
    num_fewshot (null: lm-eval's), compute, seconds, lm_eval (its version), rows (TaskRow)."""

    checkpoint: str
    target: str
    tasks: tuple[str, ...]
    rows: tuple[TaskRow, ...]
    runs: tuple[str, ...]
    limit: int | None
    num_fewshot: int | None
    compute: str = ""
    seconds: float = 0.0
    lm_eval: str = ""  # its version


def require_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise UsageError(
            "--tasks needs lm-eval-harness, which is not installed",
            hint="install the extra: pip install 'kvcalib[tasks]' (lm-eval 0.4.13)",
        ) from None
    return lm_eval


def task_manager(options: TaskOptions) -> Any:
    """lm-eval's TaskManager with the user's folders; an unknown task is refused with the close names."""
    folders = list(options.include_path)
    if options.task_data is not None:
        tasks_dir = Path(options.task_data) / "tasks"
        if not tasks_dir.is_dir():
            raise UsageError(
                f"--task-data {options.task_data}: no tasks/ folder of task YAML there",
                hint=f"lay it out with: python scripts/prepare_tasks.py {options.task_data}",
            )
        folders.append(str(tasks_dir))
    mtimes = tuple(os.stat(f).st_mtime_ns if os.path.exists(f) else -1 for f in folders)
    manager = _indexed(tuple(folders), mtimes, options.task_data is not None)
    known = set(manager.all_tasks)
    for task in options.tasks:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=5, cutoff=0.6)
            raise UsageError(
                f"unknown task {task!r}" + (f"; close names: {', '.join(close)}" if close else ""),
                hint="list lm-eval's tasks with `lm_eval ls tasks`; a task of your own: --include-path "
                "DIR with its YAML",
            )
    return manager


@functools.lru_cache(maxsize=4)
def _indexed(folders: tuple[str, ...], mtimes: tuple[int, ...], quiet: bool) -> Any:
    """lm-eval's TaskManager over its own tasks and `folders`, indexed once (seconds) per folders and `mtimes`."""
    from lm_eval.tasks import TaskManager

    index_log = logging.getLogger("lm_eval.tasks._index")
    # quiet: --task-data's YAML overrides lm-eval's on purpose, no warning line per task for that
    level = index_log.level
    index_log.setLevel(logging.ERROR if quiet else level)
    try:
        return TaskManager(include_path=list(folders) or None)
    finally:
        index_log.setLevel(level)


def check_data(manager: Any, options: TaskOptions) -> None:
    """Every task's data read before any model loads: one that cannot be read (offline, no copy) is refused."""
    offline = any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )
    for task in options.tasks:
        entry = getattr(manager, "task_index", {}).get(task)
        hub = (getattr(entry, "cfg", None) or {}).get("dataset_path")
        local = not isinstance(hub, str) or hub in LOCAL_BUILDERS or Path(hub).exists()
        if not local and not offline and not _hub_reachable():
            raise UsageError(
                f"task {task} reads {hub} from the Hugging Face hub, which this machine cannot reach",
                hint="lay out lm-eval's tasks with local data by `python scripts/prepare_tasks.py DIR` "
                "and pass --task-data DIR; copies in the Hugging Face cache: set HF_DATASETS_OFFLINE=1",
            )
        try:
            loaded = manager.load([task])["tasks"]  # {name: Task}, every leaf of a group
        except (
            Exception
        ) as exc:  # datasets raises ConnectionError, FileNotFoundError, ValueError, ...
            raise UsageError(
                f"task {task}: its data could not be read ({type(exc).__name__}: {str(exc)[:300]})",
                hint="offline: lay out lm-eval's tasks with local data by `python "
                "scripts/prepare_tasks.py DIR` and pass --task-data DIR, or give your own task YAML "
                "with --include-path",
            ) from None
        for name, task_obj in loaded.items() if options.num_fewshot else ():
            # the documents lm-eval draws few-shot examples from, less the evaluated one if from its own split
            docs = task_obj.fewshot_docs()
            same = docs is not None and any(
                docs is getattr(task_obj, f"{split}_docs")() for split in ("test", "validation")
            )
            pool = max(len(docs if docs is not None else ()) - same, 0)
            if pool < options.num_fewshot:
                raise UsageError(
                    f"--num-fewshot {options.num_fewshot}: task {name} has {pool} example(s) to draw from",
                    hint=f"pass --num-fewshot {max(pool - 1, 0)} or less",
                )


LOCAL_BUILDERS = {"json", "arrow", "csv", "parquet", "text", "pandas"}


@functools.cache
def _hub_reachable(host: str = "huggingface.co") -> bool:
    """A TCP connection to the hub within 3 s (once per process); else a download would retry for half a minute."""
    try:
        with socket.create_connection((host, 443), timeout=3):
            return True
    except OSError:
        return False


def evaluate_tasks(
    checkpoint: str, options: TaskOptions, progress: ProgressCallback | None = None
) -> TaskResult:
    """Run `options.tasks` for the baseline and each scale set; pair every run with the baseline item by item."""
    options.check_arguments()
    notify = progress or no_progress
    lm_eval = require_lm_eval()
    from kvcalib.evaluation import harness

    manager = task_manager(options)
    check_data(manager, options)
    started = time.perf_counter()
    notify(Progress("load-model"))
    loaded = harness.load(checkpoint, options)
    runs = [  # (name, scales, target)
        (BASELINE_NAME, harness.BASELINE, options.target),
        *((name, name, options.target) for name in (harness.CHECKPOINT, *options.compare)),
        *options.extra_runs,
    ]
    outputs = {}
    for done, (name, scales, target) in enumerate(runs):
        notify(Progress(f"tasks: {name} ({done + 1} of {len(runs)} runs)"))
        model = harness.KvcalibLM(loaded, target, scales, batch_size=options.batch_size)
        outputs[name] = run_lm_eval(model, options, manager)
    return TaskResult(
        str(checkpoint),
        options.target,
        options.tasks,
        tuple(row for task in options.tasks for row in paired_rows(task, outputs)),
        tuple(outputs),
        options.limit,
        options.num_fewshot,
        loaded.compute.describe(),
        time.perf_counter() - started,
        getattr(lm_eval, "__version__", ""),
    )


def run_lm_eval(model: Any, options: TaskOptions, manager: Any, **more: Any) -> LmEvalOutput:
    """lm-eval's simple_evaluate of `model` on `options.tasks`, every item logged, every seed options.seed."""
    return require_lm_eval().simple_evaluate(
        model=model,
        tasks=list(options.tasks),
        num_fewshot=options.num_fewshot,
        limit=options.limit,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
        **dict.fromkeys(
            ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"),
            options.seed,
        ),
        **more,
    )


def paired_rows(task: str, outputs: dict[str, LmEvalOutput]) -> list[TaskRow]:
    """Per metric and filter: each run's items paired with the baseline's (BASELINE_NAME, the first run) by
    (doc_id, filter); a metric not a mean over items: lm-eval's own aggregate, no interval."""
    config = outputs[list(outputs)[-1]]["configs"].get(task, {})
    rows = []
    for spec in config.get("metric_list", []):
        metric, aggregation = spec["metric"], spec.get("aggregation", "mean")
        higher_is_better = bool(spec.get("higher_is_better", True))
        reason = (
            "" if aggregation == "mean" else f"aggregated by {aggregation}, not a mean over items"
        )
        values = {
            name: _values(out["samples"].get(task, []), metric) for name, out in outputs.items()
        }
        for filter_name in sorted({f for f, _ in values[BASELINE_NAME]}):
            docs = sorted(doc for f, doc in values[BASELINE_NAME] if f == filter_name)
            items = {name: [v.get((filter_name, d)) for d in docs] for name, v in values.items()}
            means = {  # a mean over items, where every item has a number
                name: math.fsum(x) / len(x)
                for name, x in items.items()
                if aggregation == "mean" and x and all(isinstance(v, float) for v in x)
            }
            scores = {
                name: means.get(name, _aggregate(out, task, metric, filter_name))
                for name, out in outputs.items()
            }
            intervals = {
                name: paired_bootstrap(
                    [a - b for a, b in zip(items[name], items[BASELINE_NAME])],
                    worse_if_higher=not higher_is_better,
                )
                if name in means and BASELINE_NAME in means
                else None
                for name in scores
                if name != BASELINE_NAME
            }
            baseline = scores.pop(BASELINE_NAME)
            rows.append(
                TaskRow(
                    task,
                    metric,
                    filter_name,
                    len(docs),
                    higher_is_better,
                    baseline,
                    scores,
                    intervals,
                    reason,
                )
            )
    return rows


def _aggregate(output: LmEvalOutput, task: str, metric: str, filter_name: str) -> float:
    """lm-eval's own aggregate of `metric` for one run (NaN where it reported none)."""
    try:
        return float(output["results"][task][f"{metric},{filter_name}"])
    except (KeyError, TypeError, ValueError):
        return math.nan


def _values(items: list[dict[str, Any]], metric: str) -> dict[tuple[str, int], Any]:
    """(filter, doc_id) -> the item's value of `metric` (a float where it is a number)."""
    out = {}
    for item in items:
        value = item.get(metric)
        try:
            value = float(value)
        except (TypeError, ValueError):
            pass
        out[(item.get("filter", "none"), int(item["doc_id"]))] = value
    return out
