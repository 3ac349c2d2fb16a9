"""Real Gemma-3-270M (scripts/prepare_model.py): calibrated on the token stream the server builds, valid, and
evaluated under the chip's numerics with margins far outside the noise."""

from __future__ import annotations

import json

import pytest
from oracle import oracle_absmax
from real_models import FAST, calibrate_trn2_and_448, trn2_beats_448

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.evaluation.pipeline import EvalOptions, evaluate

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


@pytest.fixture(scope="module")
def gemma3_calibrated(gemma3, prose, tmp_path_factory):
    """Gemma calibrated for trn2 and as absmax/448 (real_models.calibrate_trn2_and_448), once for this file."""
    return calibrate_trn2_and_448(gemma3, prose, tmp_path_factory.mktemp("real") / "gemma-3-270m")


def _texts(path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_gemma3_calibrates_the_bos_prefixed_stream_vllm_builds(gemma3, prose, tmp_path):
    """absmax equals transformers' own cache on `<bos>` + text (what vLLM's completions endpoint
    encodes), not on the text alone. Both in float32, which is exact and quick on every CPU."""
    import torch
    from transformers import AutoTokenizer

    opts = dict(num_samples=4, max_seq_len=96)
    result = calibrate(
        gemma3,
        str(prose),
        tmp_path / "out",
        CalibrateOptions(batch_size=1, scale_objective="absmax", dtype="float32", **opts),
    )
    tok = AutoTokenizer.from_pretrained(gemma3)
    texts = _texts(prose)[
        : opts["num_samples"]
    ]  # the rows calibrate selects (their order moves no max)
    served = [tok(t, truncation=True, max_length=96)["input_ids"] for t in texts]
    assert all(s[0] == tok.bos_token_id == 2 for s in served)
    k, v = oracle_absmax(gemma3, served, dtype=torch.float32)
    assert [layer.k.absmax for layer in result.layers] == [float(x) for x in k]
    assert [layer.v.absmax for layer in result.layers] == [float(x) for x in v]
    bare_k, bare_v = oracle_absmax(gemma3, [s[1:] for s in served], dtype=torch.float32)
    ratios = [float(a / b) for a, b in zip(list(k) + list(v), list(bare_k) + list(bare_v))]
    print("absmax with <bos> / without, per layer K then V:", [round(r, 3) for r in ratios])
    # measured 0.80-1.51 here (the first token is the attention sink either way, with other values): scales
    # sized without the BOS clip on the server in some layers and waste range in others
    assert max(ratios) > 1.2 and min(ratios) < 0.9
    provenance = json.loads((tmp_path / "out" / "kvcalib_calibration.json").read_text())
    assert provenance["special_tokens_added"] == [2]


def test_gemma3_eval_scores_the_models_real_nll(gemma3_calibrated, prose):
    """With its <bos>, Gemma 3 scores prose at its real NLL (measured on these 4 x 128 fortunes: 3.98 nats with
    it, 6.21 without; 3.8 and 6.6 on 32 rows). The unquantised baseline: any calibrated checkpoint serves."""
    trn2, _ = gemma3_calibrated
    opts = dict(num_samples=4, max_seq_len=128, layer_rows=0, **FAST)
    served = evaluate(trn2, str(prose), EvalOptions(**opts))
    bare = evaluate(trn2, str(prose), EvalOptions(add_special_tokens=False, **opts))
    print(
        f"Gemma 3 NLL on fortunes: {served.baseline_nll:.3f} with <bos>, {bare.baseline_nll:.3f} without"
    )
    assert served.baseline_nll < 4.5 and bare.baseline_nll > served.baseline_nll + 1.0


def test_trn2_scales_beat_llm_compressors_448_on_trn2(gemma3_calibrated, tutorial):
    """See real_models.trn2_beats_448; Qwen2.5-Coder-0.5B's is in test_real_qwen.py (pytest-xdist runs the two
    files side by side)."""
    trn2_beats_448(gemma3_calibrated, tutorial, gap=0.008)
