"""A stand-in for a CUDA build of torch, importable only by the fake vLLM's interpreter (serve_helpers.fake_python
with cuda=True): what serve-check's CUDA probe asks, torch.version.cuda and torch.cuda.device_count().
$FAKE_CUDA_DEVICES (default 1) is how many GPUs it sees."""

import os
import types

__version__ = "2.13.0+cu128"
version = types.SimpleNamespace(cuda="12.8")


class cuda:  # noqa: N801 -- torch.cuda
    @staticmethod
    def device_count() -> int:
        return int(os.environ.get("FAKE_CUDA_DEVICES", "1"))
