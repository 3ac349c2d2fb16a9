"""calibrate --device cuda: the same scales as on the CPU (runs where torch sees a GPU, skips loudly elsewhere)."""

from __future__ import annotations

import pytest
import torch

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate

pytestmark = [
    pytest.mark.proof("cuda"),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason=f"torch {torch.__version__} sees no CUDA device"
    ),
]
SMALL = dict(num_samples=12, max_seq_len=64, batch_size=4)


def _largest_rel_diff(a, b) -> float:
    return max(
        max(abs(x.k.absmax - y.k.absmax) / y.k.absmax, abs(x.v.absmax - y.v.absmax) / y.v.absmax)
        for x, y in zip(a.layers, b.layers)
    )


def test_tiny_llama_on_cuda_equals_cpu(tiny_llama_master, text_dataset, tmp_path):
    cpu = calibrate(
        tiny_llama_master, str(text_dataset), tmp_path / "cpu", CalibrateOptions(**SMALL)
    )
    gpu = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "gpu",
        CalibrateOptions(device="cuda", **SMALL),
    )
    assert "bf16 on cuda" in gpu.compute or "float32" in gpu.compute
    assert (
        _largest_rel_diff(gpu, cpu) < 1e-4
    )  # float32 on both: kernels differ, not more than float32 rounding


@pytest.mark.slow
def test_smollm2_on_cuda_within_bf16_noise_of_cpu(smollm2, text_dataset, tmp_path):
    opts = dict(num_samples=16, max_seq_len=256)
    cpu = calibrate(smollm2, str(text_dataset), tmp_path / "cpu", CalibrateOptions(**opts))
    gpu = calibrate(
        smollm2, str(text_dataset), tmp_path / "gpu", CalibrateOptions(device="cuda", **opts)
    )
    print(
        f"SmolLM2 on cuda: {gpu.tokens_per_s:,.0f} tok/s; largest per-layer absmax difference against the CPU "
        f"{_largest_rel_diff(gpu, cpu):.2%}"
    )
    assert (
        _largest_rel_diff(gpu, cpu) <= 2**-5
    )  # bf16 on two kinds of hardware: a few bf16 steps at most
