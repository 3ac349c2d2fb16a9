"""`kvcalib.serve_check(...)`: serve-check as the command line runs it (kvcalib/__init__.py lists the API).

The environment the servers inherit, the host CPU and the memory the prediction may use are read from the
machine unless given; the CLI calls these same functions. Notes (the result's warnings) also go to the `kvcalib`
logger, one record each.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcalib.core.cpu import HostCpu
from kvcalib.serve.pipeline import ServeCheckResult, ServeEvent, ServeOptions

__all__ = ["serve_check", "serve_options"]

logger = logging.getLogger("kvcalib")


def serve_options(device: str, **fields: Any) -> ServeOptions:
    """ServeOptions as the CLI makes them: any of its fields, with the environment (os.environ), the host CPU's
    flags and the memory this process may use read from the machine unless given."""
    fields.setdefault("env", dict(os.environ))
    fields.setdefault("cpu", HostCpu.detect(with_capability=False))
    if "memory_bytes" not in fields:
        from kvcalib.hf.memory import available_memory

        fields["memory_bytes"] = available_memory().available
    return ServeOptions(device=device, **fields)


def serve_check(checkpoint: str | Path, *, device: str = "cpu", options: ServeOptions | None = None,
                progress: Callable[[ServeEvent], None] | None = None, **fields: Any) -> ServeCheckResult:
    """Serve `checkpoint` with vLLM's FP8 KV cache, probe it, compare with a baseline and always stop the servers
    (`kvcalib serve-check`). Returns the ServeCheckResult (`.ok` the verdict, `.to_dict()` the command's --json).

    Any ServeOptions field passes through (vllm_python, tp, max_model_len, baseline, canary, predict, tasks,
    context, log_dir, ...); `options`: ServeOptions made already (serve_options, or calibrate's plan).
    """
    from kvcalib.serve.pipeline import serve_check as run

    result = run(Path(checkpoint), options or serve_options(device, **fields), progress=progress)
    for note in result.warnings:
        logger.warning("%s", note)
    return result
