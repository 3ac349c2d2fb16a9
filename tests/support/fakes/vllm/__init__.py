"""A fake `vllm` package for kvcalib's tests: only `python -m vllm.entrypoints.openai.api_server`."""

__version__ = "0.32.0+fake"
