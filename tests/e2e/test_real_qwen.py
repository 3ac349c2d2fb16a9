"""Real Qwen2.5-Coder-0.5B (scripts/prepare_model.py; q/k/v biases, K absmax ~200): kvcalib's trn2 scales against
llm-compressor's absmax/448 under trn2 numerics. A file of its own so that pytest-xdist runs it beside the Gemma
tests (tests/e2e/test_real_models.py), both after the slow files, which run while the two models convert."""

from __future__ import annotations

import pytest
from real_models import calibrate_trn2_and_448, trn2_beats_448

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_trn2_scales_beat_llm_compressors_448_on_trn2(qwen25, prose, tutorial, tmp_path):
    trn2_beats_448(
        calibrate_trn2_and_448(qwen25, prose, tmp_path / "qwen2.5-coder-0.5b"),
        tutorial,
        gap=0.04,
        eval_samples=4,
    )
