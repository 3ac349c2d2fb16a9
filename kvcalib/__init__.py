"""kvcalib: FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU.

The jobs as the command line runs them (kvcalib/api.py; the CLI calls the same functions):

    result = kvcalib.calibrate("models/smollm2", "calib.jsonl", "out/smollm2-fp8kv", target="trn2")
    report = kvcalib.validate("out/smollm2-fp8kv", target="trn2")
    scored = kvcalib.evaluate("out/smollm2-fp8kv", "held-out.jsonl", compare=["unit"])
    served = kvcalib.serve_check("out/smollm2-fp8kv", device="cpu")

Importing kvcalib loads neither torch nor transformers; notes (a result's warnings) also go to the `kvcalib` logger."""

from __future__ import annotations

import logging

from kvcalib._version import __version__
from kvcalib.api import (
    calibrate,
    dequantize_mxfp4,
    evaluate,
    evaluate_context,
    evaluate_needle,
    evaluate_tasks,
    plan,
    serve_check,
    validate,
)
from kvcalib.core.records import to_json

__all__ = [
    "__version__",
    "calibrate",
    "dequantize_mxfp4",
    "evaluate",
    "evaluate_context",
    "evaluate_needle",
    "evaluate_tasks",
    "plan",
    "serve_check",
    "to_json",
    "validate",
]

logging.getLogger("kvcalib").addHandler(
    logging.NullHandler()
)  # a library's logger: the application routes it
