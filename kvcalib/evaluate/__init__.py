"""eval: FP8-KV accuracy with the target chip's own numerics, against an unquantised KV cache."""

from kvcalib.evaluate.pipeline import EvalOptions, EvalResult, RunResult, evaluate

__all__ = ["EvalOptions", "EvalResult", "RunResult", "evaluate"]
