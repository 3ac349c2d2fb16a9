"""eval: FP8-KV accuracy with the target chip's own numerics, against an unquantised KV cache.

The package is callable: `kvcalib.evaluate(checkpoint, dataset, target=...)` is kvcalib.evaluate.api.evaluate.
"""

from kvcalib.core.modules import callable_package
from kvcalib.evaluate import api
from kvcalib.evaluate.pipeline import EvalOptions, EvalResult, RunResult, evaluate

__all__ = ["EvalOptions", "EvalResult", "RunResult", "evaluate"]

callable_package(__name__, api.evaluate)
