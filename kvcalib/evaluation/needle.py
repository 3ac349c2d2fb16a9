"""eval-needle: does the model still find a fact deep in a long prompt when its cache is FP8?

The passkey retrieval test (Mohtashami & Jaggi 2023, "Landmark Attention") on the held-out text: for each length L
and depth d, a sentence with a random 6-digit key at d of a haystack (at a line break when one is near), then a
question; a trial is found when the key's digits are in the first ANSWER_TOKENS greedy tokens.

The order of work follows the chip. Neuron's prefill attends to the K/V it has just computed (bf16) and writes them
to the FP8 cache; only decoding reads the cache (neuronx_distributed_inference/modules/attention/attention_base.py),
so one unquantised prefill fills every scale set's cache. vLLM's FlashAttention backend writes K/V to the cache first
and attends from it (vllm/v1/attention/backends/flash_attn.py): on GPU, one prefill per scale set. Per length and
scale set: keys found (by depth too; Wilson interval) and the paired bootstrap difference from the unquantised cache."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvcalib.core import fp8
from kvcalib.core.errors import DatasetError, UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.evaluation.context import prepare_long_context
from kvcalib.evaluation.significance import Interval, paired_bootstrap, wilson
from kvcalib.hf.attention import ObservedCache, fan_out
from kvcalib.hf.compute import Float32Weights, compute_path
from kvcalib.hf.internals import cache_kwargs

__all__ = [
    "ANSWER_TOKENS",
    "BASELINE",
    "DEPTHS",
    "NEEDLE",
    "QUESTION",
    "NeedleResult",
    "NeedleRow",
    "Trial",
    "evaluate_needle",
    "found",
    "insertion_point",
    "needle_prompts",
]

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE = "\n\nRemember this: the magic number is {key}. The magic number is {key}.\n\n"
QUESTION = "\n\nQuestion: what is the magic number? Answer: the magic number is"
ANSWER_TOKENS = 8  # " 123456" is 1 to 7 tokens in the tokenizers measured; one to spare
SNAP = 64  # a line break at most this many tokens before the depth's position takes the needle
BASELINE = "unquantised"
MIN_HAYSTACK = 16  # tokens of held-out text a prompt must hold besides the needle and the question
DEFAULT_KEYS = 4  # trials per length x depth when --keys is not given


@dataclass(frozen=True)
class Trial:
    """One prompt: where its haystack came from, where the needle sits, and what each run answered."""

    length: int
    depth: float
    key: str
    offset: int  # first haystack token in the held-out stream
    position: int  # index of the needle's first token in the prompt
    answers: dict[str, str]

    def found(self, name: str) -> bool:
        return found(self.key, self.answers[name])

    JSON = {"found": lambda trial: {name: trial.found(name) for name in trial.answers}}


def found(key: str, answer: str) -> bool:
    """The key's digits, in order and whole, in the answer (spaces ignored: some tokenizers split digits)."""
    return key in "".join(answer.split())


@dataclass(frozen=True)
class NeedleRow:
    """One length and run: keys found, by depth, and the paired difference from the unquantised rate."""

    length: int
    name: str
    found: int
    trials: int
    by_depth: tuple[tuple[float, int, int], ...]  # (depth, found, trials)
    rate_interval: tuple[float, float]  # Wilson 95%
    # paired bootstrap of (this run found - unquantised found) over trials; None: the baseline
    difference: Interval | None

    @property
    def rate(self) -> float:
        return self.found / self.trials if self.trials else 0.0

    def verdict(self) -> str:
        """The difference's verdict (Interval.verdict, for a table), or the baseline's own rate."""
        return (
            self.difference.verdict("{:+.1%}", True)
            if self.difference
            else "the unquantised cache's own rate"
        )

    JSON = {
        "rate": "rate",
        "by_depth": lambda row: [{"depth": d, "found": f, "trials": n} for d, f, n in row.by_depth],
    }


@dataclass(frozen=True)
class NeedleResult:
    """What `eval-needle` found; to_json() is its --json: checkpoint, target, prefill ("fresh K/V (Neuron)" or "FP8
    cache (GPU vLLM)"), depths, needle, question, answer_tokens (greedy tokens read), rows, trials, seconds, plot."""

    checkpoint: str
    target: str
    prefill: str
    depths: tuple[float, ...]
    rows: tuple[NeedleRow, ...]
    trials: tuple[Trial, ...]
    seconds: float
    plot: str | None = None

    JSON = {
        "needle": lambda _: NEEDLE,
        "question": lambda _: QUESTION,
        "answer_tokens": lambda _: ANSWER_TOKENS,
    }


def insertion_point(stream: list[int], start: int, at: int, breaks: set[int]) -> int:
    """Where in stream[start:] the needle goes for index `at`: after a line break within SNAP tokens before it."""
    for back in range(min(SNAP, at)):
        if stream[start + at - back - 1] in breaks:
            return at - back
    return at


def needle_prompts(
    stream: list[int],
    prefix: list[int],
    tokenizer: Any,
    length: int,
    keys: int,
    seed: int,
) -> list[tuple[Trial, list[int]]]:
    """`keys` trials per depth (DEPTHS) at `length` tokens: prefix, haystack with the needle at depth, the question."""
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    breaks = {t for t in set(stream) if "\n" in tokenizer.decode([t])}
    rng = random.Random(f"{seed}-{length}")
    out = []
    for depth in DEPTHS:
        for _ in range(keys):
            key = str(rng.randint(100000, 999999))
            needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
            fixed = len(prefix) + len(needle) + len(question)
            body = length - fixed
            if body < MIN_HAYSTACK:
                raise UsageError(
                    f"--lengths {length}: too short for the needle and the question ({fixed} "
                    "tokens) and a haystack",
                    hint=f"pass lengths of {fixed + MIN_HAYSTACK} or more",
                )
            if len(stream) < body:
                raise DatasetError(
                    f"{len(stream)} tokens of held-out text, too few for one haystack of {body} "
                    f"(eval-needle --lengths {length})",
                    hint="pass a longer held-out text, or shorter lengths",
                )
            start = rng.randint(0, len(stream) - body)
            at = insertion_point(stream, start, round(depth * body), breaks)
            hay = stream[start : start + body]
            ids = prefix + hay[:at] + needle + hay[at:] + question
            out.append((Trial(length, depth, key, start, len(prefix) + at, {}), ids))
    return out


@torch.inference_mode()
def _forward(model: Any, ids: list[int], cache: Any) -> torch.Tensor:
    """The logits at the last of `ids`, their K/V written to (and read from) `cache`."""
    ids = torch.tensor([ids], device=model.device)
    return model(
        input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1
    ).logits


def _greedy(model: Any, cache: Any, logits: torch.Tensor) -> list[int]:
    """ANSWER_TOKENS greedy tokens after a prefill whose last logits are `logits`, decoding from `cache`."""
    got = [int(logits[0, -1].argmax())]
    while len(got) < ANSWER_TOKENS:
        got.append(int(_forward(model, got[-1:], cache)[0, -1].argmax()))
    return got


def answer(
    model: Any, ids: list[int], quantizers: dict[str, Any], reads_fp8: bool
) -> dict[str, list[int]]:
    """Each run's greedy answer to one prompt: the baseline, then every scale set (order: module docstring)."""
    runs = {BASELINE: None, **quantizers}
    caches = {name: ObservedCache(model.config, q and q.observe) for name, q in runs.items()}
    if not reads_fp8:  # one prefill on fresh K/V, written to every run's cache
        base = caches[BASELINE]
        base.observe = fan_out(list(caches.values())[1:])
        logits = _forward(model, ids, base)
        base.observe = None  # decoding writes each run's own cache only
    # else each run's prefill writes its own cache and attends from it
    return {
        name: _greedy(model, cache, _forward(model, ids, cache) if reads_fp8 else logits)
        for name, cache in caches.items()
    }


def summarise(trials: list[Trial], names: list[str]) -> tuple[NeedleRow, ...]:
    """Per length and run: keys found (by depth too), their Wilson interval, the paired difference from BASELINE."""
    rows = []
    for length in dict.fromkeys(t.length for t in trials):
        mine = [t for t in trials if t.length == length]
        base = [t.found(BASELINE) for t in mine]
        for name in names:
            hits = [t.found(name) for t in mine]
            by_depth = tuple(
                (
                    d,
                    sum(t.found(name) for t in mine if t.depth == d),
                    sum(t.depth == d for t in mine),
                )
                for d in DEPTHS
            )
            found, n = sum(hits), len(mine)
            interval = (
                None
                if name == BASELINE
                else paired_bootstrap([h - b for h, b in zip(hits, base)], worse_if_higher=False)
            )
            rows.append(NeedleRow(length, name, found, n, by_depth, wilson(found, n), interval))
    return tuple(rows)


def evaluate_needle(
    checkpoint: str | Path,
    dataset: str,
    lengths: tuple[int, ...],
    opts: Any,
    keys: int | None = None,
    progress: ProgressCallback | None = None,
) -> NeedleResult:
    """eval-needle (see the module docstring); `opts` an EvalOptions (target, compare, seed)."""
    started, notify = time.perf_counter(), progress or no_progress
    keys = DEFAULT_KEYS if keys is None else keys
    if keys < 1:
        raise UsageError(
            f"--keys {keys}: the needle needs at least one key per length and depth",
            hint=f"pass --keys 1 or more (default {DEFAULT_KEYS})",
        )
    if opts.order not in (None, fp8.NEURON_ORDER, fp8.GPU_ORDER):
        raise UsageError(
            f"--order {opts.order}: eval-needle generates in the neuron or the gpu order only",
            hint=f"score the {opts.order} order with `kvcalib eval CKPT --dataset DATA --order {opts.order}`",
        )
    job, _, tokenizer, stream, prefix = prepare_long_context(
        checkpoint, dataset, lengths, opts, notify
    )
    prompts = [
        p
        for length in lengths
        for p in needle_prompts(stream, prefix, tokenizer, length, keys, opts.seed)
    ]
    model, weights = job.model(notify), Float32Weights()
    reads_fp8 = (opts.order or job.target.order) == fp8.GPU_ORDER
    trials, done, total = [], 0, sum(len(ids) for _, ids in prompts)
    for n, (trial, ids) in enumerate(prompts):
        notify(Progress(f"needle {trial.length}", n, len(prompts), done, total))
        with compute_path(job.compute, weights):
            answers = answer(model, ids, job.quantizers, reads_fp8)
        trials.append(
            replace(trial, answers={name: tokenizer.decode(t) for name, t in answers.items()})
        )
        done += len(ids)
    return NeedleResult(
        str(checkpoint),
        opts.target,
        "FP8 cache (GPU vLLM)" if reads_fp8 else "fresh K/V (Neuron)",
        DEPTHS,
        summarise(trials, [BASELINE, *job.quantizers]),
        tuple(trials),
        time.perf_counter() - started,
    )
