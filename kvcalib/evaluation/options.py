"""What eval takes: EvalOptions (held-out text, context, needle) and TaskOptions (lm-eval tasks), both
ScoreOptions (the chip, the scale sets, the model), so `eval --dataset` and `eval-tasks` share their defaults."""

from dataclasses import dataclass

from kvcalib.core import fp8
from kvcalib.core.errors import UsageError
from kvcalib.core.options import ModelOptions, RunOptions, check_options, option

__all__ = ["EvalOptions", "ScoreOptions", "TaskOptions"]


@dataclass(frozen=True)
class ScoreOptions(ModelOptions):
    """What eval scores with, on held-out text or lm-eval tasks: the chip, the scale sets, the batch."""

    target: str = option(
        fp8.DEFAULT_TARGET,
        "Chip numerics to emulate: trn2 (240), trn3 or gpu (448).",
        panel="Scales",
        short="-t",
        choices=lambda: tuple(fp8.TARGETS),
    )
    batch_size: int = option(
        2,
        "Sequences per forward pass.",
        panel="Engine",
        minimum=1,
        what="sequences per forward pass",
    )
    compare: tuple[str, ...] = option(
        (),
        "Also run 'unit' (all scales 1.0) or another checkpoint's scales; repeatable.",
        panel="Scales",
    )


@dataclass(frozen=True)
class EvalOptions(RunOptions, ScoreOptions):
    num_samples: int = option(
        64,
        "First N rows of the split (eval-context: N samples per length).",
        minimum=1,
        what="rows of the dataset to score",
    )
    max_seq_len: int = option(
        512,
        "Tokens per sample at most.",
        minimum=2,
        what="tokens per sample: one predicts the next",
    )
    order: str | None = option(
        None,
        "Which K/V attention reads: neuron (each row's first half "
        "a prompt on fresh K/V, the rest decoded from FP8 and scored), neuron-chunked (the prompt in 128-token "
        "pieces, each reading the earlier ones from FP8: segmented prefill, prefix caching), mxfp8 (decode over "
        "Trainium 3's MXFP8 block cache: no per-tensor scale is used) or gpu (all read FP8). Default: the target's.",
        panel="Scales",
        choices=lambda: fp8.ORDERS,
    )
    fp8_attention: bool = option(
        False,
        "Also run every checkpoint that has q_scale as FP8 attention: Q quantised "
        "with the target's numerics too, the attention matmuls on the FP8 values in "
        "float32.",
        panel="Scales",
    )
    layer_rows: int = option(
        2,
        "Rows on which each layer is quantised alone, for its own ΔNLL (one forward pass "
        "per layer and scale set); 0: skip.",
        panel="Output",
        minimum=0,
        what="rows on which each layer is quantised alone",
    )


@dataclass(frozen=True)
class TaskOptions(ScoreOptions):
    tasks: tuple[str, ...] = ()
    limit: int | None = option(
        None, "With --tasks: items per task (lm-eval's --limit).", minimum=1, what="items per task"
    )
    num_fewshot: int | None = option(
        None,
        "With --tasks: examples in each prompt (lm-eval's).",
        minimum=0,
        what="examples in each prompt",
    )
    include_path: tuple[str, ...] = option(
        (), "With --tasks: a folder of task YAML (lm-eval's); repeatable."
    )
    task_data: str | None = option(
        None,
        "With --tasks: task data laid out offline by scripts/prepare_tasks.py "
        "DIR (lm-eval's tasks, local data).",
    )
    seed: int = 1234  # lm-eval's own default seeds (few-shot sampling)
    # library only: more runs on the same items, (name, scales, target), e.g. other chips' numerics in one pass
    extra_runs: tuple[tuple[str, str, str], ...] = ()

    def check_arguments(self) -> None:
        if not self.tasks:
            raise UsageError(
                "--tasks names no task", hint="pass e.g. --tasks lambada_openai,arc_easy"
            )
        check_options(self)
