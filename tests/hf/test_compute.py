"""The host CPU (flags, what they allow) and bf16 computed through float32 matmuls (kvcalib.cpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcalib.calibration.options import CalibrateOptions, Machine
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core.cpu import ComputePath, HostCpu, choose_compute, parse_cpu_flags
from kvcalib.core.errors import UsageError
from kvcalib.hf.compute import UPCAST_BLOCK_ELEMENTS, Float32Weights, bf16_via_float32

AVX2_EPYC = HostCpu(frozenset({"fpu", "sse2", "avx", "avx2", "fma"}), "AVX2")
AVX512_BF16 = HostCpu(frozenset({"avx2", "avx512f", "avx512bw", "avx512_bf16"}), "AVX512")
SAPPHIRE_RAPIDS = HostCpu(frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}), "AVX512")
AVX512_NO_BF16 = HostCpu(frozenset({"avx2", "avx512f", "avx512bw"}), "AVX512")


def test_cpu_flags_from_cpuinfo(tmp_path):
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\n"
    assert parse_cpu_flags(x86) == {"fpu", "sse2", "avx2", "avx512f"}
    assert parse_cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert parse_cpu_flags("processor\t: 0\n") is None
    path = tmp_path / "cpuinfo"
    path.write_text(x86)
    assert HostCpu.from_cpuinfo(path, "AVX512").flags == {"fpu", "sse2", "avx2", "avx512f"}
    assert HostCpu.from_cpuinfo(tmp_path / "missing").flags is None
    injected = HostCpu.from_cpuinfo(path, "AVX512", override="avx2,fma")
    assert injected.flags == {"avx2", "fma"} and injected.source == "KVCALIB_CPU_FLAGS"


@pytest.mark.parametrize(
    "cpu, native_bf16, vllm_fp8_kv",
    [
        (AVX2_EPYC, False, False),
        (AVX512_BF16, True, True),
        (SAPPHIRE_RAPIDS, True, True),
        (AVX512_NO_BF16, False, True),
        (
            HostCpu(frozenset({"avx512f", "avx512_bf16"}), "AVX2"),
            False,
            True,
        ),  # ATEN_CPU_CAPABILITY=avx2
        (HostCpu(None), None, None),
    ],
    ids=["avx2-epyc", "avx512-bf16", "amx", "avx512-no-bf16", "capability-avx2", "unknown"],
)
def test_what_a_cpu_allows(cpu, native_bf16, vllm_fp8_kv):
    assert cpu.native_bf16 is native_bf16
    assert cpu.vllm_fp8_kv is vllm_fp8_kv


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "requested, dtype, device, cpu, expected, reason",
    [
        (
            "auto",
            torch.bfloat16,
            CPU,
            AVX2_EPYC,
            "float32",
            "no native bf16 matmul (needs avx512_bf16 or amx_bf16)",
        ),
        ("auto", torch.bfloat16, CPU, AVX512_BF16, "native", "native bf16 matmul"),
        ("auto", torch.bfloat16, CPU, None, "native", "CPU not known"),
        ("auto", torch.float32, CPU, AVX2_EPYC, "native", "the model runs in float32"),
        ("float32", torch.float16, CPU, AVX2_EPYC, "native", "the model runs in float16"),
        ("auto", torch.bfloat16, CUDA, AVX2_EPYC, "native", "bf16 on cuda"),
        ("native", torch.bfloat16, CPU, AVX2_EPYC, "native", "--bf16-compute native"),
        ("float32", torch.bfloat16, CPU, AVX512_BF16, "float32", "--bf16-compute float32"),
    ],
)
def test_compute_path_choice(requested, dtype, device, cpu, expected, reason):
    path = choose_compute(requested, dtype, device, cpu)
    assert path.bf16_matmul == expected and reason in path.reason


def test_emulated_linear_is_float32_math_rounded_once_to_bf16():
    torch.manual_seed(0)
    x, w, b = (
        torch.randn(3, 7, 64).bfloat16(),
        torch.randn(96, 64).bfloat16(),
        torch.randn(96).bfloat16(),
    )
    with bf16_via_float32():
        y, y_nobias = F.linear(x, w, b), F.linear(x, w)
        z = torch.nn.Linear(64, 96, dtype=torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).bfloat16())
    assert torch.equal(y_nobias, F.linear(x.float(), w.float()).bfloat16())
    assert w.dtype == torch.bfloat16  # the weight itself is never converted


def test_emulated_linear_upcasts_a_large_weight_in_row_blocks():
    torch.manual_seed(0)
    rows = UPCAST_BLOCK_ELEMENTS // 32 + 3  # more rows than one block holds
    x, w, b = (
        torch.randn(2, 32).bfloat16(),
        torch.randn(rows, 32).bfloat16(),
        torch.randn(rows).bfloat16(),
    )
    with bf16_via_float32():
        y = F.linear(x, w, b)
    assert y.shape == (2, rows) and torch.equal(
        y, F.linear(x.float(), w.float(), b.float()).bfloat16()
    )


def test_emulated_grouped_mm_is_each_experts_float32_product_rounded_once():
    """MoE experts (transformers' grouped_mm): each expert's rows times its own weight in float32, rounded once to
    bf16, the [experts, in, out] weight never upcast whole; empty groups and rows past the last group are zero.
    Other layouts run natively."""
    torch.manual_seed(0)
    a, b = torch.randn(40, 64).bfloat16(), torch.randn(4, 64, 96).bfloat16()
    offs = torch.tensor(
        [10, 10, 25, 36], dtype=torch.int32
    )  # expert 1 gets no rows; rows 36.. none
    with bf16_via_float32():
        out = F.grouped_mm(a, b, offs=offs)
    bounds = [0, 10, 10, 25, 36]
    expected = torch.zeros(40, 96, dtype=torch.bfloat16)
    for e in range(4):
        expected[bounds[e] : bounds[e + 1]] = (
            a[bounds[e] : bounds[e + 1]].float() @ b[e].float()
        ).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    x = torch.randn(4, 5, 64).bfloat16()
    with bf16_via_float32():  # 3-D x 3-D (batched) is not the experts' layout: left to torch
        batched = F.grouped_mm(x, b)
    assert torch.equal(batched, F.grouped_mm(x, b))


def test_other_dtypes_and_ops_are_untouched():
    torch.manual_seed(0)
    x32, w32 = torch.randn(4, 8), torch.randn(5, 8)
    xb = torch.randn(4, 8).bfloat16()
    with bf16_via_float32():
        assert torch.equal(F.linear(x32, w32), F.linear(x32, w32))
        assert (xb @ xb.T).dtype == torch.bfloat16
        assert torch.equal(torch.matmul(xb, xb.T), (xb.float() @ xb.float().T).bfloat16())
        assert torch.equal(torch.nn.functional.silu(xb), F.silu(xb))


def _sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    return 10 * torch.log10(ref.pow(2).sum() / (x.double() - ref).pow(2).sum()).item()


@pytest.mark.parametrize("case", ["causal", "padding-mask", "gqa", "additive-mask", "decode-rows"])
def test_emulated_attention_matches_the_native_kernel(case):
    """Close to torch's native bf16 CPU kernel, and as accurate against a float64 reference."""
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 96, 32
    q, k, v = (
        (torch.randn(b, h, s, d) * 2).bfloat16(),
        (torch.randn(b, h, s, d) * 2).bfloat16(),
        torch.randn(b, h, s, d).bfloat16(),
    )
    kwargs: dict = {}
    if case == "causal":
        kwargs["is_causal"] = True
    elif case == "padding-mask":
        mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None].repeat(b, 1, 1, 1)
        mask[1, :, :, 80:] = False  # the second row is padded after 80 tokens
        mask[1, :, 80:, 0] = (
            True  # (padded queries still see a real token, as transformers' masks do)
        )
        kwargs["attn_mask"] = mask
    elif case == "gqa":
        k, v = k[:, :2], v[:, :2]
        kwargs.update(is_causal=True, enable_gqa=True)
    elif case == "additive-mask":
        kwargs["attn_mask"] = (
            torch.zeros(s, s)
            .masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            .bfloat16()
        )
    else:  # a few new query rows against a longer cache
        q = q[:, :, -4:]
        kwargs["attn_mask"] = torch.ones(4, s, dtype=torch.bool)
    native = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with bf16_via_float32():
        emulated = F.scaled_dot_product_attention(q, k, v, **kwargs)
    ref_kwargs = {
        key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
        for key, val in kwargs.items()
    }
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **ref_kwargs)
    assert emulated.dtype == torch.bfloat16 and emulated.shape == native.shape
    assert (
        emulated == native
    ).float().mean() > 0.95  # the same roundings as the native kernel, nearly everywhere
    assert _sqnr_db(emulated, exact) > _sqnr_db(native, exact) - 0.5
    assert _sqnr_db(emulated, exact) > 45  # bf16 output rounding (~52 dB) dominates


@pytest.mark.parametrize("case", ["causal-gqa", "padding-mask"])
def test_query_blocks_change_the_work_not_the_values(case, monkeypatch):
    """The emulated attention's causal query blocks leave out the columns after their last row (about half of a
    prefill's scores): against one block over every column, the same outputs but for the order of float32 sums,
    a bf16 ulp in a few outputs in 100,000."""
    from kvcalib.hf import compute

    torch.manual_seed(0)
    q = (torch.randn(3, 8, 256, 64) * 2).bfloat16()
    k, v = (torch.randn(3, 2, 256, 64) * 2).bfloat16(), torch.randn(3, 2, 256, 64).bfloat16()
    kwargs: dict = {"enable_gqa": True}
    if case == "causal-gqa":
        kwargs["is_causal"] = True
    else:
        mask = torch.ones(256, 256, dtype=torch.bool).tril()[None, None].repeat(3, 1, 1, 1)
        mask[2, :, :, 170:] = False
        mask[2, :, 170:, 0] = True
        kwargs["attn_mask"] = mask
    assert compute.SDPA_QUERY_BLOCK < 256
    with bf16_via_float32():
        blocked = F.scaled_dot_product_attention(q, k, v, **kwargs)
        monkeypatch.setattr(compute, "SDPA_QUERY_BLOCK", 1 << 20)
        whole = F.scaled_dot_product_attention(q, k, v, **kwargs)
    differ = blocked != whole
    assert differ.float().mean() < 1e-4
    ulp = 2.0 ** (torch.frexp(whole.float())[1] - 8).float()  # bf16 keeps 8 significant bits
    assert ((blocked.float() - whole.float()).abs() <= ulp).all()


def test_a_bf16_model_keeps_its_weights_under_emulation(tiny_llama_master):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_master, dtype=torch.bfloat16).eval()
    before = {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()}
    ids = torch.tensor([list(range(5, 40))])
    with torch.inference_mode():
        native = model(input_ids=ids).logits
        with bf16_via_float32():
            emulated = model(input_ids=ids).logits
    assert {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()} == before
    assert emulated.dtype == torch.bfloat16
    assert _sqnr_db(emulated.float(), native.double()) > 30  # the same bf16 model, other roundings


def test_kept_float32_weights_change_nothing_but_the_upcasts(tiny_llama_master):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_master, dtype=torch.bfloat16).eval()
    ids = torch.tensor([list(range(5, 40)), list(range(40, 75))])
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    kept, none_kept = Float32Weights(), Float32Weights(budget=0)
    with torch.inference_mode():
        with bf16_via_float32():
            plain = model(input_ids=ids).logits
        with bf16_via_float32(kept):
            first, again = model(input_ids=ids).logits, model(input_ids=ids).logits
        with bf16_via_float32(none_kept):
            over_budget = model(input_ids=ids).logits
    assert (
        torch.equal(first, plain) and torch.equal(again, plain) and torch.equal(over_budget, plain)
    )
    assert kept.used == sum(
        w.numel() * 4 for w in {id(w): w for w in linears}.values()
    )  # each weight once
    assert all(
        kept.get(w).dtype == torch.float32 and torch.equal(kept.get(w), w.float()) for w in linears
    )
    assert (
        none_kept.used == 0 and none_kept.get(linears[0]) is None
    )  # past the budget: upcast per call
    assert (
        Float32Weights().get(torch.ones(3, 3, dtype=torch.bfloat16)) is None
    )  # activations are never kept
    assert all(w.dtype == torch.bfloat16 for w in model.parameters())


def test_streamed_equals_in_memory_on_the_float32_path(tiny_llama_master, text_dataset, tmp_path):
    opts = dict(
        num_samples=12, max_seq_len=64, batch_size=4, dtype="bfloat16", bf16_compute="float32"
    )
    memory = calibrate(
        tiny_llama_master, str(text_dataset), tmp_path / "memory", CalibrateOptions(**opts)
    )
    streamed = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "stream",
        CalibrateOptions(engine="stream", **opts),
    )
    assert [(layer.k.absmax, layer.v.absmax) for layer in streamed.layers] == [
        (layer.k.absmax, layer.v.absmax) for layer in memory.layers
    ]
    assert memory.compute.startswith(
        "bf16 model, matmuls and attention in float32 with bf16 rounding"
    )


def test_calibrate_says_which_path_it_took(tiny_llama_master, text_dataset, tmp_path):
    opts = dict(num_samples=4, max_seq_len=32, dtype="bfloat16")
    on_avx2 = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "a",
        CalibrateOptions(**opts),
        Machine.read(CalibrateOptions(), cpu=AVX2_EPYC),
    )
    assert (
        on_avx2.compute
        == ComputePath(
            "float32",
            f"{AVX2_EPYC.describe()}: no native bf16 matmul (needs avx512_bf16 or amx_bf16)",
        ).describe()
    )
    assert "CPU avx2 (from /proc/cpuinfo), torch capability AVX2" in on_avx2.compute
    on_amx = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "b",
        CalibrateOptions(**opts),
        Machine.read(CalibrateOptions(), cpu=SAPPHIRE_RAPIDS),
    )
    assert on_amx.compute.startswith("native matmuls in the model's dtype")
    with pytest.raises(UsageError, match="unknown --bf16-compute 'fast'"):
        calibrate(
            tiny_llama_master,
            str(text_dataset),
            tmp_path / "c",
            CalibrateOptions(bf16_compute="fast", **opts),
        )
    assert not (tmp_path / "c").exists()
