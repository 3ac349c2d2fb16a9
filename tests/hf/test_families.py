"""K/V exactly as every served model family writes them to its KV cache, in memory and streamed.

For each family a tiny random model (its own word-level tokenizer, sharded safetensors) is
calibrated in float32 by the native and the stream engine, and compared with an oracle that
owes nothing to kvcalib: the model's own eager attention and a DynamicCache that keeps every
token, one row at a time, absmax over the (unpadded, so all real) tokens. The oracle checks
itself (cached and uncached logits are equal). Each layer's K is scaled by its own power of
two, so the layers differ clearly and a layer mix-up shows.
"""

from __future__ import annotations

import json

import pytest
import torch
from families import FAMILIES, family_config
from helpers import build_word_tokenizer
from oracle import calibration_sequences, oracle_heads

import kvcalib
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core.records import to_json
from kvcalib.hf.internals import cache_kwargs

OPTS = dict(num_samples=6, max_seq_len=48, batch_size=3, target="gpu")


def scale_k_per_layer(model: torch.nn.Module) -> None:
    """Layer i's K x 2^(i+1) (exact): through k_norm where the model has one, else k_proj or the fused qkv_proj.

    Q x 4 as well, so that attention logits are large enough for soft-capping (Gemma2) to matter.
    """
    with torch.no_grad():
        for module in model.modules():
            i = getattr(module, "layer_idx", None)
            if not (isinstance(i, int) and type(module).__name__.endswith("Attention")):
                continue
            factor = 2.0 ** (i + 1)
            if hasattr(module, "q_proj"):
                module.q_proj.weight.mul_(4.0)
            if hasattr(module, "k_norm"):
                (
                    module.k_norm.weight.mul_(factor)
                    if module.k_norm.weight.abs().sum()
                    else module.k_norm.weight.add_(factor - 1)
                )
            elif hasattr(module, "k_proj"):
                module.k_proj.weight.mul_(factor)
                if module.k_proj.bias is not None:
                    module.k_proj.bias.mul_(factor)
            else:  # Phi3: [q | k | v] rows
                q = module.config.num_attention_heads * module.head_dim
                kv = module.config.num_key_value_heads * module.head_dim
                module.qkv_proj.weight[:q].mul_(4.0)
                module.qkv_proj.weight[q : q + kv].mul_(factor)


@pytest.fixture(
    scope="module",
    params=FAMILIES,
)
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tokenizer = build_word_tokenizer()
    config = family_config(request.param, len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    scale_k_per_layer(model)
    out = tmp_path_factory.mktemp(request.param) / request.param
    model.save_pretrained(out, max_shard_size="100KB")
    tokenizer.save_pretrained(out)
    assert len(list(out.glob("*.safetensors"))) > 1, "sharded, so the index is used"
    return request.param, out


def oracle(model_dir, sequences) -> tuple[list[float], list[float]]:
    """Per-layer K/V absmax from the model's own eager attention and a full DynamicCache, row by row, in the
    checkpoint's own dtype."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype="auto"
    ).eval()
    n = model.config.num_hidden_layers
    k, v = [0.0] * n, [0.0] * n
    with torch.inference_mode():
        for seq in sequences:
            ids = torch.tensor([seq])
            cache = DynamicCache()  # no config: every layer keeps every token, sliding ones too
            cached = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
            assert torch.equal(cached, model(input_ids=ids, use_cache=False).logits), (
                "the oracle checks itself"
            )
            for i, layer in enumerate(cache.layers):
                k[i] = max(k[i], layer.keys.abs().max().item())
                v[i] = max(v[i], layer.values.abs().max().item())
    return k, v


@pytest.mark.parametrize("engine", ["native", "stream"])
def test_absmax_equals_the_models_own_cache(family, engine, text_dataset, tmp_path):
    name, model_dir = family
    result = calibrate(
        model_dir, str(text_dataset), tmp_path / "out", CalibrateOptions(engine=engine, **OPTS)
    )
    k, v = oracle(
        model_dir,
        calibration_sequences(model_dir, text_dataset, OPTS["num_samples"], OPTS["max_seq_len"]),
    )
    assert len(result.layers) == 3
    assert len({round(x / k[0], 3) for x in k}) == 3, "the layers' K must differ clearly"
    for layer in result.layers:
        assert layer.k.absmax == pytest.approx(k[layer.layer], rel=1e-6), (name, layer.layer, "K")
        assert layer.v.absmax == pytest.approx(v[layer.layer], rel=1e-6), (name, layer.layer, "V")
    assert result.validation.ok is True


@pytest.mark.parametrize("engine", ["native", "stream"])
def test_per_head_and_q_absmax_equal_the_models_own(family, engine, text_dataset, tmp_path):
    """--strategy attn_head --attention-scales: K/V per KV head as the model's cache holds them, Q per head as the
    model hands it to its own attention function (after RoPE, and q-norm in Qwen3), for every family."""
    name, model_dir = family
    result = calibrate(
        model_dir,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(engine=engine, strategy="attn_head", attention_scales=True, **OPTS),
    )
    k, v, q = oracle_heads(
        model_dir,
        calibration_sequences(model_dir, text_dataset, OPTS["num_samples"], OPTS["max_seq_len"]),
    )
    for layer in result.layers:
        i = layer.layer
        for mine, theirs in (
            (layer.k.head_absmax, k[i]),
            (layer.v.head_absmax, v[i]),
            (layer.q.head_absmax, q[i]),
        ):
            assert len(mine) == theirs.numel(), (name, i)
            assert list(mine) == pytest.approx(theirs.tolist(), rel=1e-6), (name, i)
        assert layer.q.absmax == max(layer.q.head_absmax)
        assert len(layer.k.head_absmax) == 2 and len(layer.q.head_absmax) == 4
    assert len({round(max(k[i]).item() / max(q[i]).item(), 3) for i in range(3)}) == 3, "Q is not K"
    assert result.validation.ok is True


def build_released_gpt_oss(out):
    """A tiny GPT-OSS as released: bf16, its experts quantised to MXFP4 (as OpenAI's files hold them)."""
    from mxfp4 import save_as_mxfp4
    from transformers import AutoModelForCausalLM

    tokenizer = build_word_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        family_config("gpt_oss", len(tokenizer), tokenizer.pad_token_id)
    )
    scale_k_per_layer(model)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_as_mxfp4(out)
    return out


def test_gpt_oss_with_mxfp4_experts_is_calibrated_as_released(tmp_path, text_dataset):
    """GPT-OSS as released (MXFP4 experts, quantised by the test itself): calibrated for Neuron directly, the
    experts dequantised in memory by transformers, with the absmax of the bf16-dequantised checkpoint bit for bit
    (in memory and streamed); the output keeps the released weights as hard links and writes nothing bf16;
    --target gpu is refused with the reason and the form that works there, which is then calibrated too."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from typer.testing import CliRunner

    from kvcalib import dequantize_mxfp4  # the public name the refusal's hint gives
    from kvcalib.cli import app
    from kvcalib.validation.pipeline import validate_checkpoint

    released = build_released_gpt_oss(tmp_path / "gpt-oss-mxfp4")
    assert (
        json.loads((released / "config.json").read_text())["quantization_config"]["quant_method"]
        == "mxfp4"
    )
    # validate gives the platform's own verdict on the released form: MX quantization is refused on Neuron
    assert "NEURON-QCFG-MX" in [f.rule for f in validate_checkpoint(released, "trn2").errors]

    gpu = CliRunner().invoke(
        app,
        [
            "calibrate",
            str(released),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "gpu"),
            "--num-samples",
            "4",
            "--max-seq-len",
            "32",
            "--target",
            "gpu",
        ],
    )
    assert gpu.exit_code != 0 and "Traceback" not in gpu.stderr
    assert (
        "GPU vLLM's MXFP4 support loads no KV scales" in gpu.stderr
        and "dequantize_mxfp4(" in gpu.stderr
    )
    assert not (tmp_path / "gpu").exists()

    # the GPU form: experts dequantised to bf16 by transformers, then calibrated
    bf16 = dequantize_mxfp4(released, tmp_path / "gpt-oss-bf16", max_shard_size="100KB")
    loaded, info = AutoModelForCausalLM.from_pretrained(bf16, output_loading_info=True)
    assert (
        not info["missing_keys"] and not info["unexpected_keys"]
    )  # every expert weight written and read back
    dequantized = AutoModelForCausalLM.from_pretrained(
        released, quantization_config=Mxfp4Config(dequantize=True)
    )
    assert torch.equal(
        loaded.model.layers[1].mlp.experts.gate_up_proj,
        dequantized.model.layers[1].mlp.experts.gate_up_proj,
    )
    runs = {}
    for name, source, engine, target in [
        ("bf16-gpu", bf16, "native", "gpu"),
        ("bf16", bf16, "native", "trn2"),
        ("mxfp4", released, "native", "trn2"),
        ("mxfp4-stream", released, "stream", "trn2"),
    ]:
        runs[name] = calibrate(
            source,
            str(text_dataset),
            tmp_path / name,
            CalibrateOptions(**{**OPTS, "target": target, "engine": engine}),
        )
    k, v = oracle(
        bf16, calibration_sequences(bf16, text_dataset, OPTS["num_samples"], OPTS["max_seq_len"])
    )
    for layer in runs["bf16-gpu"].layers:
        assert layer.k.absmax == pytest.approx(k[layer.layer], rel=1e-6)
        assert layer.v.absmax == pytest.approx(v[layer.layer], rel=1e-6)
    assert validate_checkpoint(tmp_path / "bf16-gpu", "gpu").ok
    for target in ("trn2", "gpu"):
        assert validate_checkpoint(tmp_path / "bf16", target).ok

    def measured(result):
        return [
            (
                layer.k.absmax,
                layer.v.absmax,
                layer.k.scale,
                layer.v.scale,
                layer.k.range,
                layer.v.range,
            )
            for layer in result.layers
        ]

    assert (
        measured(runs["mxfp4"]) == measured(runs["bf16"]) == measured(runs["mxfp4-stream"])
    )  # bit for bit
    out = tmp_path / "mxfp4"
    weights = {p.name: p for p in out.glob("model-*.safetensors")}
    assert weights and all(
        p.stat().st_nlink > 1 for p in weights.values()
    )  # the released bytes, linked
    written = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.stat().st_nlink == 1)
    assert written < 200_000, (
        written
    )  # scales, config, card, tokenizer: nothing bf16 (the experts alone are ~1 MB)
    config = json.loads((out / "config.json").read_text())
    assert (
        config["quantization_config"]["quant_method"] == "compressed-tensors"
    )  # KV-only: the platform accepts it
    provenance = json.loads((out / "kvcalib_calibration.json").read_text())
    assert (
        provenance["mxfp4_weights"] == 6
        and provenance["source_quantization_config"]["quant_method"] == "mxfp4"
    )
    rules = {
        t: [(f.rule, f.severity) for f in validate_checkpoint(out, t).findings]
        for t in ("trn2", "trn3", "gpu")
    }
    assert (
        rules["trn2"] == [("PORT-MXFP4-NEURON", "info")] and validate_checkpoint(out, "trn3").ok
    ), rules
    assert ("PORT-MXFP4-GPU", "error") in rules["gpu"], rules
    card = (out / "README.md").read_text()
    assert (
        """--additional-config '{"neuron_config": {"quantization": "bf16"}}'""" in card
        and "Not for GPU" in card
    )
    # kvcalib reads its own Neuron form back (eval dequantises the linked experts the same way)
    scored = kvcalib.evaluate(out, str(text_dataset), num_samples=2, max_seq_len=16, layer_rows=0)
    assert scored.baseline_nll > 0
    # calibrate --plan on the released checkpoint: no refusal for trn2, the GPU refusal for --target gpu
    for target, refused in (("trn2", False), ("gpu", True)):
        planned = CliRunner().invoke(
            app,
            [
                "calibrate",
                str(released),
                "--dataset",
                str(text_dataset),
                "-o",
                str(tmp_path / f"plan-{target}"),
                "--num-samples",
                "4",
                "--max-seq-len",
                "32",
                "--target",
                target,
                "--plan",
                "--json",
            ],
        )
        assert planned.exit_code == 0 and "Traceback" not in planned.stderr, planned.stderr
        refusals = json.loads(planned.stdout)["refusals"]
        assert bool(refusals) == refused and (
            not refused or "GPU vLLM's MXFP4 support" in refusals[0]
        ), refusals
        assert not (tmp_path / f"plan-{target}").exists()


class _Comparing:
    """Runs each attention call itself: the model's own function, and the scale objective's recomputation
    (kvcalib.hf.samples.attention_rows) of the same rows, side by side."""

    sees_attention_calls = True

    def __init__(self, sampler):
        self.sampler, self.outputs = sampler, {}

    def attend(self, function, module, query, key, value, attention_mask, *args, **kwargs):
        self.sampler.record(module.layer_idx, query, key, value, attention_mask, kwargs, module)
        output, weights = function(module, query, key, value, attention_mask, *args, **kwargs)
        self.outputs[module.layer_idx] = output.detach()  # [batch, seq, heads, head_dim]
        return output, weights


@pytest.mark.parametrize("attn", ["eager", "kvcalib's"])
def test_the_objectives_attention_is_the_models_own(family, attn, text_dataset):
    """The scale objective scores attention outputs it recomputes from the samples (mask rows, scaling,
    soft-capping, sinks, grouped heads): equal to what the model's own attention function returns for those
    rows, for every family, padded batch included."""
    from transformers import AutoModelForCausalLM

    from kvcalib.hf.attention import ObservedCache, observing_attention
    from kvcalib.hf.data import batches
    from kvcalib.hf.model import faithful_attention
    from kvcalib.hf.samples import AttentionSampler, attention_rows

    name, model_dir = family
    if (
        attn != "eager"
    ):  # what kvcalib runs: transformers' default, eager where SDPA would drop soft-capping
        attn = faithful_attention(json.loads((model_dir / "config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attn, dtype=torch.float32
    ).eval()
    sequences = [tuple(s) for s in calibration_sequences(model_dir, text_dataset, 4, 40)]
    sampler = AttentionSampler(3, sequences, rows=64)  # every position of every sequence
    ids, mask = next(batches(tuple(sequences), 4, 0))
    hook = _Comparing(sampler)
    sampler.start_batch(ids, mask)
    with torch.inference_mode(), observing_attention(model, hook):
        model.model(
            input_ids=ids,
            attention_mask=mask,
            use_cache=True,
            **cache_kwargs(
                model.model,
                ObservedCache(model.config, (hook_cache := _PassThrough()).observe, store=False),
            ),
        )
    assert hook_cache.calls == 3
    order = sorted(sequences, key=len, reverse=True)
    for layer in range(3):
        assert len(sampler.samples[layer]) == len(sequences)
        for row, sample in enumerate(sampler.samples[layer]):
            mine, _ = attention_rows(sample)  # [kv_heads, groups * rows, head_dim]
            positions = list(range(1, len(order[row])))
            theirs = hook.outputs[layer][row, positions].transpose(0, 1)  # [heads, rows, head_dim]
            theirs = theirs.reshape(mine.shape)
            assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), (name, attn, layer, row)


class _Calls:
    """Sees every attention call and does nothing with it."""

    sees_attention_calls, calls = True, 0

    def observe_call(self, module, query, key, value, attention_mask, kwargs):
        self.calls += 1


@pytest.mark.parametrize("attn", ["eager", None])
def test_observed_attention_is_the_models_own_bit_for_bit(family, attn, text_dataset):
    """observing_attention switches the model to kvcalib's registered attention function and back: it runs the
    model's own (eager, or transformers' default: SDPA where the family has it) for every call, so a padded batch's
    logits are bit for bit the unobserved ones (soft-capping, sliding windows, sinks included)."""
    from transformers import AutoModelForCausalLM

    from kvcalib.hf.attention import observing_attention
    from kvcalib.hf.data import batches

    name, model_dir = family
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attn, dtype=torch.float32
    ).eval()
    loaded = model.config._attn_implementation
    sequences = [tuple(s) for s in calibration_sequences(model_dir, text_dataset, 3, 40)]
    ids, mask = next(batches(tuple(sequences), 3, 0))
    hook = _Calls()
    with torch.inference_mode():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with observing_attention(model, hook):
            assert model.config._attn_implementation == f"kvcalib_{loaded}"
            observed = model(input_ids=ids, attention_mask=mask).logits
    assert hook.calls == 3 and model.config._attn_implementation == loaded, (name, loaded)
    assert torch.equal(observed, plain), (name, loaded)


def test_a_model_whose_attention_bypasses_the_interface_is_refused():
    """Falcon's attention modules (transformers 5.17) never ask transformers' AttentionInterface for their function:
    observing its attention calls is refused by name, and the model is left as it was loaded. Where the release's
    Falcon asks the interface (5.25), it is observed as any family is, and restored after."""
    import inspect

    from transformers import FalconConfig, FalconForCausalLM
    from transformers.models.falcon import modeling_falcon

    from kvcalib.core.errors import UnsupportedModelError
    from kvcalib.hf.attention import observing_attention

    model = FalconForCausalLM(
        FalconConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    )
    loaded = model.config._attn_implementation
    if "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(modeling_falcon):
        with observing_attention(model, _Calls()):
            assert model.config._attn_implementation == f"kvcalib_{loaded}"
    else:
        with pytest.raises(
            UnsupportedModelError, match="FalconForCausalLM's attention does not go"
        ):
            with observing_attention(model, _Calls()):
                pass
    assert model.config._attn_implementation == loaded


class _PassThrough:
    calls = 0

    def observe(self, layer_idx, key, value):
        self.calls += 1


def test_mxfp4_dequantised_a_few_experts_at_a_time_is_transformers_own():
    """kvcalib.hf.mxfp4.expert_chunks: transformers' dequantisation, as its loader calls it (the module's
    `convert_moe_packed_tensors`, under both releases' `dequantize_convertops`), run on chunks of experts into one
    result: bit for bit what it returns for the whole tensor."""
    from transformers.integrations import mxfp4 as integration

    from kvcalib.hf import mxfp4

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (10, 6, 2, 16), dtype=torch.uint8)
    scales = torch.randint(117, 137, (10, 6, 2), dtype=torch.uint8)
    whole = integration.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    with mxfp4.expert_chunks(per_chunk=3):
        chunked = integration.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert (
        integration.convert_moe_packed_tensors.__name__ == "convert_moe_packed_tensors"
    )  # restored
    assert chunked.shape == whole.shape == (10, 64, 6) and torch.equal(chunked, whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_dequantised_by_table_is_transformers_own(dtype):
    """kvcalib.hf.mxfp4.dequantize (a table of every byte's values under every scale, then a gather): bit for
    bit transformers' `convert_moe_packed_tensors`, over every byte and every scale (0 and 255 included: 2^-127,
    and inf times the codes, NaN for the zeros), on GPT-OSS-120B's 90 blocks a row, experts a chunk apart."""
    from transformers.integrations import mxfp4 as integration

    from kvcalib.hf import mxfp4

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (5, 48, 90, 16), dtype=torch.uint8)
    scales = torch.randint(0, 256, (5, 48, 90), dtype=torch.uint8)
    scales[0, 0], blocks[0, 0] = (
        torch.arange(90),
        torch.arange(256).reshape(16, 16).repeat(6, 1)[:90],
    )
    want = integration.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = mxfp4.dequantize(blocks, scales, dtype=dtype, per_chunk=2)
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    assert got.shape == want.shape == (5, 90 * 32, 48) and got.dtype == want.dtype
    assert torch.equal(got.view(bits), want.view(bits))


def test_the_stream_engine_dequantises_mxfp4_from_the_stored_bytes(
    tmp_path, text_dataset, monkeypatch
):
    """The stream loader hands transformers' dequantisation the MXFP4 blocks and scales as stored (uint8), as
    from_pretrained does for a pre-quantized checkpoint: loaded without the quantizer, transformers casts them to
    the model's dtype first, and for GPT-OSS-120B that bf16 copy of a layer's blocks was 2 GiB of the peak."""
    from mxfp4 import build_gpt_oss_mxfp4

    from kvcalib.hf import mxfp4

    seen = []
    original = mxfp4.dequantize  # what transformers' dequantisation calls while kvcalib loads

    def recording(blocks, scales, **kwargs):
        seen.append((blocks.dtype, scales.dtype))
        return original(blocks, scales, **kwargs)

    monkeypatch.setattr(mxfp4, "dequantize", recording)
    released = build_gpt_oss_mxfp4(tmp_path / "released", layers=2)
    calibrate(
        released,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(
            **{**OPTS, "target": "trn2", "engine": "stream", "scale_objective": "absmax"}
        ),
    )
    assert seen and set(seen) == {(torch.uint8, torch.uint8)}, seen


def test_released_gpt_oss_streamed_gets_the_objectives_picks_as_in_memory(tmp_path):
    """GPT-OSS as released (MXFP4), calibrated for trn2 with the default objective: --max-memory 0 streams it, and
    its picks equal the in-memory run's, to the bit."""
    from helpers import fortune_texts, write_jsonl

    released = build_released_gpt_oss(tmp_path / "gpt-oss-mxfp4")
    data = write_jsonl(
        tmp_path / "data.jsonl", [{"text": t} for t in fortune_texts(160, chars=200)]
    )
    opts = dict(num_samples=160, max_seq_len=32, batch_size=8, target="trn2")
    whole, streamed = (
        calibrate(released, str(data), tmp_path / name, CalibrateOptions(**opts, **more))
        for name, more in [("whole", {}), ("streamed", {"max_memory": 0})]
    )
    assert [to_json(layer) for layer in streamed.layers] == [
        to_json(layer) for layer in whole.layers
    ]
