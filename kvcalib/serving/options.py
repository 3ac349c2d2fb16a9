"""What serve-check takes (ServeOptions). Real annotations (kvcalib.core.options reads a field's type as it is)."""

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvcalib.core.errors import UsageError
from kvcalib.core.fp8 import TARGETS
from kvcalib.core.options import check_options, option
from kvcalib.serving.prompts import MIN_CONTEXT, Prompt

if TYPE_CHECKING:
    from kvcalib.serving.tasks import TaskSpec

__all__ = ["DEVICES", "NEURON_DEVICES", "ServeOptions"]

NEURON_DEVICES = tuple(name for name, target in TARGETS.items() if target.neuron)  # trn2, trn3
DEVICES = (*NEURON_DEVICES, "cpu", "cuda")
serving = partial(option, panel="Serving")


@dataclass(frozen=True)
class ServeOptions:
    device: Literal[DEVICES] = option(
        help="trn2 or trn3 (vLLM on Neuron), cpu (vLLM on CPU) or cuda (vLLM on GPU).",
        panel="Engine",
    )
    tp: int | None = serving(
        None,
        "Tensor-parallel size (default: every NeuronCore; 1 on cpu).",
        minimum=1,
        what="tensor-parallel size",
    )
    max_model_len: int = serving(
        2048,
        "Also the server's max-num-batched-tokens (Neuron needs them equal).",
        minimum=1,
        what="tokens per sequence",
    )
    max_num_seqs: int = serving(
        4,
        "Sequences the server runs at once.",
        minimum=1,
        what="sequences at once",
    )
    port: int | None = serving(
        None,
        "Port on 127.0.0.1 (default: a free one).",
        minimum=1,
        what="a TCP port",
    )
    startup_timeout_s: float = serving(
        1800.0,
        "Seconds to wait for GET /health.",
        flag="--startup-timeout",
        minimum=1,
        what="seconds to wait for the server",
    )
    stop_timeout_s: float = serving(
        60.0,
        "Seconds between SIGTERM and SIGKILL.",
        flag="--stop-timeout",
        minimum=0,
        what="seconds between SIGTERM and SIGKILL",
    )
    prompts: tuple[Prompt, ...] | None = None  # None: BUILTIN_PROMPTS (the CLI's --prompts FILE)
    baseline: bool | None = serving(
        None,
        "Also serve without FP8 KV and compare (default: on for cpu).",
        flag="--baseline/--no-baseline",
    )
    max_tokens: int = 32
    vllm_python: Path = serving(
        help="Interpreter of the environment with vLLM (default: this Python).",
        factory=lambda: Path(sys.executable),
    )
    log_dir: Path | None = serving(
        None,
        "Where the server logs go (default: a new temporary directory, kept).",
    )
    neuron_visible_devices: str | None = serving(
        None, "NEURON_VISIBLE_DEVICES for the server, e.g. 0-7."
    )
    force: bool = serving(False, "Serve scales sized for a larger FP8 max than the chip's.")
    # the environment servers and tools inherit (default: this process's)
    env: Mapping[str, str] = field(
        default_factory=lambda: dict(os.environ), repr=False
    )  # no secrets in a repr
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    canary: bool | None = serving(
        None,
        "Also serve a copy with every K/V scale divided by 64, which must answer worse: proof that the "
        "server applies the scales (default: on for cpu and cuda, off on Neuron, where each copy is another "
        "compile).",
        flag="--canary/--no-canary",
    )
    predict: bool = serving(
        True,
        "kvcalib's emulated ΔNLL of the probe text (in-process on CPU) next to the served one.",
        flag="--predict/--no-predict",
    )
    tasks: "TaskSpec | None" = None  # lm-eval tasks against the baseline and FP8 servers
    context: int | None = serving(
        None,
        "Also send a passkey prompt of about this many tokens (within --max-model-len): the FP8 server "
        "must find the key where the baseline does.",
        minimum=MIN_CONTEXT,
        what="tokens in the long prompt",
    )

    def check_arguments(self) -> None:
        """The values a user passes, checked before anything is read or started (UsageError naming the flag)."""
        check_options(self)
        if self.context is not None and self.context + self.max_tokens > self.max_model_len:
            raise UsageError(
                f"--context {self.context} plus the {self.max_tokens} tokens of the answer exceeds "
                f"--max-model-len {self.max_model_len}",
                hint=f"pass --max-model-len {self.context + self.max_tokens} or more, "
                "or a shorter --context",
            )
        if self.port is not None and self.port > 65535:
            raise UsageError(
                f"--port must be at most 65535, not {self.port}",
                hint="pass a TCP port, or leave it out",
            )
