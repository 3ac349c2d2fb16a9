"""eval's scoring order: the Neuron order in one forward is prefill + token-by-token decode from an FP8 cache; the
order follows the target unless --order says otherwise, and --json and the table say which was scored."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.core import fp8
from kvcalib.core.errors import UsageError
from kvcalib.core.records import to_json
from kvcalib.evaluation.emulate import FreshPrefill, KVQuantizer, decode_rows
from kvcalib.evaluation.pipeline import EvalOptions, evaluate
from kvcalib.hf.attention import ObservedCache, fan_out, observed_forward, observing_attention
from kvcalib.hf.internals import cache_kwargs

LENGTHS = (11, 6)  # two rows, right-padded: prompts of 6 and 3 tokens


@torch.inference_mode()
def _one_forward(model, ids, mask, hook):
    with observing_attention(model, hook):
        return observed_forward(model, ids, mask, hook and hook.observe).logits


@torch.inference_mode()
def _prefill_then_decode(model, row, quantizer):
    """Neuron's order literally: the prompt attends to fresh K/V while the FP8 cache is written (fan_out, as the
    needle probe does), then each later token alone, reading the cache with its own K/V quantised first, as the
    decode kernel writes them (fp8.tkg_write)."""
    p = (len(row) + 1) // 2
    cache = ObservedCache(model.config, quantizer.observe)
    logits = [
        model(
            input_ids=torch.tensor([row[:p]]),
            **cache_kwargs(model, ObservedCache(model.config, fan_out([cache]))),
            use_cache=True,
        ).logits[0]
    ]
    cache.observe = replace(quantizer, target=fp8.tkg_write(quantizer.target)).observe
    for token in row[p:]:
        logits.append(
            model(
                input_ids=torch.tensor([[token]]), **cache_kwargs(model, cache), use_cache=True
            ).logits[0]
        )
    return torch.cat(logits)


def test_the_neuron_order_in_one_forward_is_prefill_then_token_by_token_decode(tiny_llama_master):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_master, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    quantizer = KVQuantizer(
        [0.01] * layers, [0.01] * layers, fp8.get_target("trn2")
    )  # coarse: a visible change
    rows = [[(7 * i + 3 * r) % 200 + 5 for i in range(n)] for r, n in enumerate(LENGTHS)]
    ids = torch.tensor([row + [0] * (max(LENGTHS) - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (max(LENGTHS) - len(row)) for row in rows])
    assert decode_rows(mask).sum(1).tolist() == [5, 3]

    neuron = _one_forward(model, ids, mask, FreshPrefill(quantizer, mask))
    gpu = _one_forward(model, ids, mask, quantizer)
    fresh = _one_forward(model, ids, mask, None)  # unquantised
    for b, row in enumerate(rows):
        literal = _prefill_then_decode(model, row, quantizer)
        p = (len(row) + 1) // 2
        assert (neuron[b, : len(row)] - literal).abs().max() < 1e-4
        assert torch.equal(neuron[b, :p], fresh[b, :p])  # the prompt never reads the cache
        # the decode steps do, and unlike the GPU order's prompt: both far outside 1e-4
        assert (neuron[b, p : len(row)] - fresh[b, p : len(row)]).abs().max() > 1e-2
        assert (neuron[b, :p] - gpu[b, :p]).abs().max() > 1e-2


class _Pieces(DynamicCache):
    """The cache of a prompt sent in pieces, literally: each piece's K/V stored as swa_fused_cte writes them, the
    piece attending to the stored earlier pieces and its own fresh K/V; then (`decoding`) each step's K/V stored as
    the decode kernel writes them, and everything read from the cache."""

    def __init__(self, config, quantizer):
        super().__init__(config=config)
        self.quantizer, self.decoding = quantizer, False

    def update(self, key, value, layer_idx, *args, **kwargs):
        q = self.quantizer
        if self.decoding:
            written = replace(q, target=fp8.tkg_write(q.target)).observe(layer_idx, key, value)
            return super().update(*written, layer_idx, *args, **kwargs)
        k, v = (
            fp8.swa_fused_cte_round_trip(x, s[layer_idx], q.target)
            for x, s in ((key, q.k_scales), (value, q.v_scales))
        )
        stored_k, stored_v = super().update(k, v, layer_idx, *args, **kwargs)
        n = key.shape[2]
        return torch.cat([stored_k[:, :, :-n], key], 2), torch.cat([stored_v[:, :, :-n], value], 2)


def test_the_chunked_neuron_order_in_one_forward_is_the_prompt_in_pieces_then_decode(
    tiny_llama_master,
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_master, dtype=torch.float32).eval()
    layers, chunk = model.config.num_hidden_layers, 2
    quantizer = KVQuantizer([0.01] * layers, [0.01] * layers, fp8.get_target("trn2"))
    rows = [[(7 * i + 3 * r) % 200 + 5 for i in range(n)] for r, n in enumerate(LENGTHS)]
    ids = torch.tensor([row + [0] * (max(LENGTHS) - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (max(LENGTHS) - len(row)) for row in rows])
    chunked = _one_forward(model, ids, mask, FreshPrefill(quantizer, mask, chunk))
    whole = _one_forward(model, ids, mask, FreshPrefill(quantizer, mask))
    for b, row in enumerate(rows):
        p = (len(row) + 1) // 2
        cache = _Pieces(model.config, quantizer)
        pieces = [row[start : min(start + chunk, p)] for start in range(0, p, chunk)]
        logits = []
        with torch.inference_mode():
            for piece in pieces + [[token] for token in row[p:]]:
                cache.decoding = len(logits) >= len(pieces)
                out = model(
                    input_ids=torch.tensor([piece]), **cache_kwargs(model, cache), use_cache=True
                )
                logits.append(out.logits[0])
        literal = torch.cat(logits)
        assert (chunked[b, : len(row)] - literal).abs().max() < 1e-4
        assert torch.equal(
            chunked[b, :chunk], whole[b, :chunk]
        )  # the first piece reads nothing from the cache
    # the later pieces of the longer prompt do, far outside 1e-4
    assert (chunked[0, chunk:3] - whole[0, chunk:3]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def calibrated(tiny_llama_master, text_dataset, tmp_path_factory):
    from kvcalib.calibration.options import CalibrateOptions
    from kvcalib.calibration.pipeline import calibrate

    out = tmp_path_factory.mktemp("order") / "cal"
    calibrate(
        tiny_llama_master, str(text_dataset), out, CalibrateOptions(num_samples=4, max_seq_len=64)
    )
    return out


def test_the_order_follows_the_target_and_scores_the_decode_steps(calibrated, text_dataset):
    runs = {
        (target, order): evaluate(
            calibrated,
            str(text_dataset),
            EvalOptions(target=target, order=order, num_samples=4, max_seq_len=64, layer_rows=0),
        )
        for target, order in (("trn2", None), ("trn2", "gpu"), ("gpu", None), ("gpu", "neuron"))
    }
    assert [r.order for r in runs.values()] == ["neuron", "gpu", "gpu", "neuron"]
    # GPU: every prediction but each row's last; Neuron: the decode steps', from ⌈n/2⌉ to n-2
    lengths = [int(n) for n in _lengths(calibrated, text_dataset)]
    assert runs["trn2", "gpu"].num_tokens == sum(n - 1 for n in lengths)
    assert runs["trn2", None].num_tokens == sum(n // 2 - 1 for n in lengths)
    assert to_json(runs["trn2", None])["order"] == "neuron"


def _lengths(checkpoint, dataset):
    from kvcalib.hf.data import load_calibration_data
    from kvcalib.hf.model import load_tokenizer

    data = load_calibration_data(
        str(dataset),
        load_tokenizer(checkpoint, False),
        EvalOptions(num_samples=4, max_seq_len=64),
    )
    return [len(s) for s in data.sequences]


def test_eval_json_and_table_say_which_order(calibrated, text_dataset):
    args = [
        "eval",
        str(calibrated),
        "--dataset",
        str(text_dataset),
        "--num-samples",
        "2",
        "--max-seq-len",
        "32",
        "--layer-rows",
        "0",
        "--json",
    ]
    default, gpu = (CliRunner().invoke(app, args + more) for more in ([], ["--order", "gpu"]))
    assert default.exit_code == 0 and gpu.exit_code == 0, default.stderr + gpu.stderr
    assert (
        json.loads(default.stdout)["order"] == "neuron" and json.loads(gpu.stdout)["order"] == "gpu"
    )
    assert "scored in the Neuron order (prefill reads fresh K/V, decode reads FP8" in default.stderr
    assert "scored in the GPU order (every position reads FP8)" in gpu.stderr
    wrong = CliRunner().invoke(app, args + ["--order", "tpu"])
    assert wrong.exit_code != 0 and "tpu" in wrong.stderr


def test_rows_too_short_to_decode_are_refused_with_the_way_out(calibrated, tmp_path):
    data = tmp_path / "short.jsonl"
    data.write_text(json.dumps({"text": "Hi"}) + "\n")
    with pytest.raises(UsageError, match="nothing to score in the neuron order") as raised:
        evaluate(calibrated, str(data), EvalOptions(target="trn2", max_seq_len=3, layer_rows=0))
    assert "--order gpu" in raised.value.hint


def test_serve_checks_prediction_is_in_the_order_of_the_server_it_predicts(calibrated):
    from kvcalib.serving.predict import predict

    cpu, neuron = (predict(calibrated, n, None, False, None, []) for n in ("vllm-cpu", "trn2"))
    assert (cpu.order, neuron.order) == (
        "gpu",
        "neuron",
    )  # vLLM on CPU reads the cache for prefill too
    assert len(neuron.token_delta) < len(cpu.token_delta)  # the decode steps only
