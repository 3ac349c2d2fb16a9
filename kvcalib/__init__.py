"""kvcalib: FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU."""

from __future__ import annotations

__version__ = "0.1.0"
