"""kvcalib's trn2 quantiser is the Neuron plugin's write path, code for code, on SmolLM2's real K/V."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import fortune_texts

from kvcalib.core import fp8
from kvcalib.hf.attention import ObservedCache
from kvcalib.hf.internals import cache_kwargs

pytestmark = pytest.mark.slow
LAYERS = (0, 1, 14, 29)


def plugin_write(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A transcription of jinhuang12/vllm-neuron at ed3580d, vllm_neuron/model/llama3/model.py, _write_kv_cache:
    bf16 K/V times the stored bf16 reciprocal (fp8_kv_golden.py: 1.0 / torch.tensor([scale], bfloat16)), clamped at
    FP8_CLAMP_MAX (240 on trn2), cast to the cache's dtype."""
    return (
        (x * (1.0 / torch.tensor([scale], dtype=torch.bfloat16)))
        .clamp(-240.0, 240.0)
        .to(torch.float8_e4m3fn)
    )


class _Recorder:
    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(self, layer_idx, key, value):
        if layer_idx in LAYERS:
            self.kv[layer_idx] = (key.clone(), value.clone())


def test_trn2_quantiser_equals_the_plugins_write_path_on_real_kv(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).eval()
    ids = AutoTokenizer.from_pretrained(smollm2)(
        " ".join(fortune_texts(8, chars=200)), return_tensors="pt"
    )
    recorder = _Recorder()
    with torch.inference_mode():
        model(
            **ids,
            use_cache=True,
            **cache_kwargs(model, ObservedCache(model.config, recorder.observe, store=False)),
        )
    trn2 = fp8.get_target("trn2")
    f32_product = dataclasses.replace(trn2, bf16_product=False)
    codes = changed = 0
    for key, value in recorder.kv.values():
        for x in (key, value):
            assert x.dtype == torch.bfloat16
            scale = float(fp8.scale_from_absmax(x.float().abs().max(), trn2))
            # dequantised by the same reciprocal, equal values are equal codes (a division by r is one-to-one)
            plugin = plugin_write(x, scale).float() / fp8.neuron_reciprocal(scale)
            assert torch.equal(fp8.fake_quantize(x.float(), scale, trn2), plugin)
            changed += int((fp8.fake_quantize(x.float(), scale, f32_product) != plugin).sum())
            codes += x.numel()
    print(f"{changed / codes:.2%} of {codes} FP8 codes differ with a float32 product")
    assert (
        changed > 0.005 * codes
    )  # the float32 product is one step off on a share of them: the test has teeth
