"""Real Gemma-3-270M and Qwen2.5-Coder-0.5B (scripts/prepare_model.py): calibrated on the token stream
the server builds, valid, and evaluated under the chip's numerics with margins far outside the noise."""

from __future__ import annotations

import json

import pytest
from helpers import fortune_texts, tutorial_texts, write_jsonl
from oracle import oracle_absmax

from kvcalib.calibrate import CalibrateOptions, calibrate
from kvcalib.evaluate import EvalOptions, evaluate
from kvcalib.validate.pipeline import validate_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
FAST = dict(bf16_compute="float32")  # native bf16 is slow on AVX2; the comparison is about the KV quantiser


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """Held-out text: the Python tutorial."""
    path = tmp_path_factory.mktemp("tutorial") / "tutorial.jsonl"
    return write_jsonl(path, [{"text": t} for t in tutorial_texts(8)])


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    path = tmp_path_factory.mktemp("prose") / "fortunes.jsonl"
    return write_jsonl(path, [{"text": t} for t in fortune_texts(24, chars=800)])


def _texts(path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_gemma3_calibrates_the_bos_prefixed_stream_vllm_builds(gemma3, prose, tmp_path):
    """absmax equals transformers' own cache on `<bos>` + text (what vLLM's completions endpoint
    encodes), not on the text alone. Both in float32, which is exact and quick on every CPU."""
    import torch
    from transformers import AutoTokenizer

    opts = dict(num_samples=4, max_seq_len=96)
    result = calibrate(gemma3, str(prose), tmp_path / "out", CalibrateOptions(
        batch_size=1, scale_objective="absmax", dtype="float32", **opts))
    tok = AutoTokenizer.from_pretrained(gemma3)
    texts = _texts(prose)[:opts["num_samples"]]  # the rows calibrate selects (their order moves no max)
    served = [tok(t, truncation=True, max_length=96)["input_ids"] for t in texts]
    assert all(s[0] == tok.bos_token_id == 2 for s in served)
    k, v = oracle_absmax(gemma3, served, dtype=torch.float32)
    assert [layer.k_absmax for layer in result.layers] == [float(x) for x in k]
    assert [layer.v_absmax for layer in result.layers] == [float(x) for x in v]
    bare_k, bare_v = oracle_absmax(gemma3, [s[1:] for s in served], dtype=torch.float32)
    ratios = [float(a / b) for a, b in zip(list(k) + list(v), list(bare_k) + list(bare_v))]
    print("absmax with <bos> / without, per layer K then V:", [round(r, 3) for r in ratios])
    # measured 0.80-1.51 here (the first token is the attention sink either way, with other values): scales
    # sized without the BOS clip on the server in some layers and waste range in others
    assert max(ratios) > 1.2 and min(ratios) < 0.9
    provenance = json.loads((tmp_path / "out" / "kvcalib_calibration.json").read_text())
    assert provenance["special_tokens_added"] == [2]


def test_gemma3_eval_scores_the_models_real_nll(gemma3, prose, tmp_path):
    """With its <bos>, Gemma 3 scores prose at its real NLL (measured on these 4 x 128 fortunes: 3.98 nats with
    it, 6.21 without; 3.8 and 6.6 on 32 rows)."""
    calibrate(gemma3, str(prose), tmp_path / "ckpt", CalibrateOptions(num_samples=4, max_seq_len=96, **FAST))
    opts = dict(num_samples=4, max_seq_len=128, layer_rows=0, **FAST)
    served = evaluate(tmp_path / "ckpt", str(prose), EvalOptions(**opts))
    bare = evaluate(tmp_path / "ckpt", str(prose), EvalOptions(add_special_tokens=False, **opts))
    print(f"Gemma 3 NLL on fortunes: {served.baseline_nll:.3f} with <bos>, {bare.baseline_nll:.3f} without")
    assert served.baseline_nll < 4.5 and bare.baseline_nll > served.baseline_nll + 1.0


# calibrated on 8 x 256 fortunes, scored on 8 x 256 tokens of the Python tutorial, measured: Gemma-3-270M
# calibrated +0.016, absmax/448 +0.033; Qwen2.5-Coder-0.5B +0.043, +0.127. Each bound is half the gap.
GAPS = {"gemma3": 0.008, "qwen25": 0.04}


@pytest.mark.parametrize("model", ["gemma3", "qwen25"])
def test_trn2_scales_beat_llm_compressors_448_on_trn2(model, prose, tutorial, tmp_path, request):
    """calibrate (the default objective) for trn2, validate, and eval on trn2 numerics against
    absmax/448 (llm-compressor's convention, which clips every value above 240/448 of absmax on trn2).
    On 16 x 256 held-out tokens of the Python tutorial (scripts/objective_table.py): Qwen2.5-Coder-0.5B
    +0.036 against +0.112, Gemma-3-270M +0.011 against +0.044."""
    path = request.getfixturevalue(model)
    opts = dict(num_samples=8, max_seq_len=256, **FAST)
    ours = calibrate(path, str(prose), tmp_path / "trn2", CalibrateOptions(target="trn2", **opts))
    theirs = calibrate(path, str(prose), tmp_path / "448", CalibrateOptions(target="gpu", scale_objective="absmax",
                                                                            **opts))
    assert ours.scale_objective == "attention" and theirs.scale_objective == "absmax"
    report = validate_checkpoint(tmp_path / "trn2", "trn2")
    assert report.ok, report
    result = evaluate(tmp_path / "trn2", str(tutorial), EvalOptions(target="trn2", compare=(str(tmp_path / "448"),),
                                                                    layer_rows=0, **opts))
    own, clipped = result.runs
    print(f"{model} on trn2: calibrated {own.delta_nll:+.4f}, absmax/448 {clipped.delta_nll:+.4f}")
    assert own.delta_nll < 0.05
    assert clipped.delta_nll > own.delta_nll + GAPS[model]
