"""vllm.platforms.current_platform, as vLLM 0.32 exposes it: $FAKE_VLLM_PLATFORM names the build (default cpu;
cuda for a CUDA build). The Neuron plugin's presence is what makes the fake a Neuron server, as in vLLM."""

import os


class _Platform:
    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.device_name = device_type

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"


current_platform = _Platform(os.environ.get("FAKE_VLLM_PLATFORM", "cpu"))
