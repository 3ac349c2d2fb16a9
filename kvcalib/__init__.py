"""kvcalib: FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU.

The Python API is the jobs as the command line runs them (kvcalib/api.py; the CLI calls the same functions):

    import kvcalib

    result = kvcalib.calibrate("models/smollm2", "calib.jsonl", "out/smollm2-fp8kv", target="trn2")
    report = kvcalib.validate("out/smollm2-fp8kv", target="trn2")
    scored = kvcalib.evaluate("out/smollm2-fp8kv", "held-out.jsonl", compare=["unit"])
    served = kvcalib.serve_check("out/smollm2-fp8kv", device="cpu")

The jobs themselves are the packages kvcalib.calibration, kvcalib.validation, kvcalib.evaluation and
kvcalib.serving; their options are declared once, in their options dataclasses. Importing kvcalib loads neither
torch nor transformers. Notes (a result's warnings) go to `logging.getLogger("kvcalib")` too.
"""

from __future__ import annotations

import logging

from kvcalib._version import __version__
from kvcalib.api import (calibrate, evaluate, evaluate_context, evaluate_needle, evaluate_tasks, plan, serve_check,
                         validate)

__all__ = ["__version__", "calibrate", "evaluate", "evaluate_context", "evaluate_needle", "evaluate_tasks", "plan",
           "serve_check", "validate"]

logging.getLogger("kvcalib").addHandler(logging.NullHandler())  # a library's logger: the application routes it
