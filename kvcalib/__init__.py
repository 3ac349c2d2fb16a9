"""kvcalib: FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU.

The Python API, the jobs as the command line runs them (the CLI calls the same functions):

    import kvcalib

    result = kvcalib.calibrate("models/smollm2", "calib.jsonl", "out/smollm2-fp8kv", target="trn2")
    report = kvcalib.validate("out/smollm2-fp8kv", target="trn2")
    scored = kvcalib.evaluate("out/smollm2-fp8kv", "held-out.jsonl", compare=["unit"])
    served = kvcalib.serve_check("out/smollm2-fp8kv", device="cpu")

- calibrate(model, dataset, output, *, target, num_samples, max_seq_len, recipe, scale_objective, serve_check,
  ...) -> CalibrationResult  (kvcalib.calibrate.api)
- validate(path, *, target, strict) -> ValidationReport  (kvcalib.validate.api)
- evaluate(checkpoint, dataset, *, target, compare, ...) -> EvalResult, and evaluate_tasks, evaluate_context,
  evaluate_needle  (kvcalib.evaluate.api)
- serve_check(checkpoint, *, device, ...) -> ServeCheckResult  (kvcalib.serve.api)

`kvcalib.calibrate`, `kvcalib.validate` and `kvcalib.evaluate` are the job packages themselves, made callable, so
`from kvcalib.calibrate import CalibrateOptions` works beside `kvcalib.calibrate(...)`. Importing kvcalib loads
neither torch nor transformers; a job imports what it needs when it is first used. Notes (a result's warnings)
go to `logging.getLogger("kvcalib")` too.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from kvcalib._version import __version__

__all__ = ["__version__", "calibrate", "evaluate", "evaluate_context", "evaluate_needle", "evaluate_tasks",
           "serve_check", "validate"]

if TYPE_CHECKING:  # what a type checker sees; at run time these are the callable packages and functions below
    from kvcalib.calibrate.api import calibrate
    from kvcalib.evaluate.api import evaluate, evaluate_context, evaluate_needle, evaluate_tasks
    from kvcalib.serve.api import serve_check
    from kvcalib.validate.api import validate

logging.getLogger("kvcalib").addHandler(logging.NullHandler())  # a library's logger: the application routes it

_PACKAGES = ("calibrate", "validate", "evaluate")  # callable job packages
_FUNCTIONS = {"serve_check": "kvcalib.serve.api", "evaluate_tasks": "kvcalib.evaluate.api",
              "evaluate_context": "kvcalib.evaluate.api", "evaluate_needle": "kvcalib.evaluate.api"}


def __getattr__(name: str) -> Any:
    """The API, imported on first use (PEP 562)."""
    if name in _PACKAGES:
        return importlib.import_module(f"kvcalib.{name}")
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'kvcalib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
