"""serve-check: serve a checkpoint with vLLM's FP8 KV cache, probe it, judge it, always stop it."""

from kvcalib.serve.pipeline import (
    ServeCheckResult,
    ServeEvent,
    ServeOptions,
    serve_check,
)

__all__ = ["ServeCheckResult", "ServeEvent", "ServeOptions", "serve_check"]
