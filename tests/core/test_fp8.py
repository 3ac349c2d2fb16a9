"""The FP8 numerics: the chip-faithful quantiser against hand-computed values, and the scale rule."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvcalib.core import fp8

TRN2, TRN3, GPU = fp8.TARGETS["trn2"], fp8.TARGETS["trn3"], fp8.TARGETS["gpu"]

# (name, target, scale, x, expected x̂), computed by hand:
# e4m3fn keeps 3 mantissa bits: step 2^(e-3) in [2^e, 2^(e+1)); subnormals step 2^-9; ties to even.
# Neuron: r = bf16(1/bf16(s)); x̂ = clamp(x·r, ±max) rounded to e4m3 / r. GPU: x̂ = sat(x/s) · s.
QUANTISER_CASES = [
    ("zero", TRN2, 1.0, 0.0, 0.0),
    ("exact grid value", TRN2, 1.0, 1.125, 1.125),
    ("tie rounds to even", TRN2, 1.0, 1.0625, 1.0),
    ("rounds to nearest", TRN2, 1.0, 1.1, 1.125),
    ("negative", TRN2, 1.0, -3.3, -3.25),
    ("trn2 max is 240", TRN2, 1.0, 240.0, 240.0),
    ("trn2 clamps just above", TRN2, 1.0, 241.0, 240.0),
    ("trn2 clamps 448", TRN2, 1.0, 448.0, 240.0),
    ("trn2 clamps negative", TRN2, 1.0, -1000.0, -240.0),
    ("largest subnormal grid", TRN2, 1.0, 2.0**-7, 2.0**-7),
    ("smallest subnormal", TRN2, 1.0, 0.001, 2.0**-9),
    ("below half the smallest subnormal", TRN2, 1.0, 0.0009, 0.0),
    ("subnormal tie to even", TRN2, 1.0, 1.5 * 2.0**-9, 2.0**-8),
    ("trn3 keeps 448", TRN3, 1.0, 448.0, 448.0),
    ("trn3 clamps above 448", TRN3, 1.0, 500.0, 448.0),
    ("trn3 between 240 and 448", TRN3, 1.0, 300.0, 288.0),
    # s = 0.3 -> bf16(s) = 0.30078125, 1/bf16(s) = 3.32467.. -> r = bf16 3.328125
    # 10 · r = 33.28 -> e4m3 32 (step 4 in [32, 64)) -> 32 / 3.328125
    ("neuron reciprocal in bf16", TRN2, 0.3, 10.0, 32.0 / 3.328125),
    ("neuron clamp with a scale", TRN2, 0.5, 200.0, 240.0 / 2.0),
    # GPU: 100 / 2 = 50 -> tie between 48 and 52 -> even mantissa 48 -> · 2
    ("gpu divides by s", GPU, 2.0, 100.0, 96.0),
    ("gpu saturates at 448", GPU, 2.0, 1000.0, 896.0),
    ("gpu keeps the scale in float32", GPU, 0.3, 10.0, 32.0 * 0.3),  # 33.3 -> 32
]


@pytest.mark.parametrize(
    "name,target,scale,x,expected", QUANTISER_CASES, ids=[c[0] for c in QUANTISER_CASES]
)
def test_fake_quantize_matches_hand_computed_values(name, target, scale, x, expected):
    got = fp8.fake_quantize(torch.tensor([x], dtype=torch.float32), scale, target).item()
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-12), name


def test_fake_quantize_keeps_dtype_and_shape():
    x = torch.randn(2, 3, 5, 16, dtype=torch.bfloat16)
    y = fp8.fake_quantize(x, 0.01, TRN2)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


@pytest.mark.parametrize("target", [TRN2, TRN3, GPU], ids=lambda t: t.name)
def test_sqnr_floor_for_calibrated_gaussian(target):
    """A calibrated per-tensor scale on Gaussian data: FP8 E4M3 gives ~30 dB, never below 25."""
    torch.manual_seed(0)
    x = torch.randn(4096) * 3.0
    s = fp8.scale_from_absmax(x.abs().max(), target).item()
    noise = (fp8.fake_quantize(x, s, target) - x).pow(2).sum().item()
    assert fp8.sqnr_db(x.pow(2).sum().item(), noise) > 25.0


@pytest.mark.parametrize("target", [TRN2, TRN3, GPU], ids=lambda t: t.name)
@pytest.mark.parametrize(
    "absmax", [1e-3, 0.07, 1.0, 4.6838, 15.69, 20.5, 239.9, 300.0, 1234.5, 1e6]
)
def test_scale_rule(target, absmax):
    """s >= absmax/fp8_max, at most 2^-6 above it, and the chip maps absmax inside ±fp8_max."""
    s = fp8.scale_from_absmax(absmax, target).item()
    exact = absmax / target.fp8_max
    assert exact * (1 - 1e-7) <= s <= exact * (1 + fp8.SCALE_ROUNDING_TOLERANCE)
    assert fp8.to_fp8_domain(torch.tensor(absmax), s, target).item() <= target.fp8_max
    assert fp8.bf16_reciprocal_ok(s)
    if target.neuron:  # on the bf16 grid: the plugin reads it exactly
        assert torch.tensor(s).to(torch.bfloat16).float().item() == s


def test_scale_floor_for_zero_absmax():
    for target in (TRN2, GPU):
        s = fp8.scale_from_absmax(0.0, target).item()
        floor32 = torch.tensor(fp8.SCALE_FLOOR, dtype=torch.float32).item()
        assert floor32 <= s <= floor32 * (1 + fp8.SCALE_ROUNDING_TOLERANCE)
        assert fp8.bf16_reciprocal_ok(s)


def test_scale_is_elementwise():
    s = fp8.scale_from_absmax(torch.tensor([2.4, 24.0, 240.0]), TRN2)
    assert s.dtype == torch.float32 and s.shape == (3,)
    assert s.tolist() == [fp8.scale_from_absmax(a, TRN2).item() for a in (2.4, 24.0, 240.0)]


def test_sqnr_db_edges():
    assert fp8.sqnr_db(1.0, 0.0) == math.inf
    assert fp8.sqnr_db(100.0, 1.0) == pytest.approx(20.0)


def test_unknown_target_names_the_known_ones():
    with pytest.raises(
        ValueError, match=r"^unknown target 'h100'; known targets: gpu, trn2, trn3$"
    ):
        fp8.get_target("h100")


@pytest.mark.parametrize(
    "target",
    [
        fp8.get_target("vllm-cpu"),
        fp8.Target(
            "e5m2-toward-zero", "float8_e5m2", 57344.0, fp8.F32_RECIPROCAL, toward_zero=True
        ),
    ],
    ids=lambda t: t.name,
)
def test_numerics_truncating_toward_zero(target):
    """A cast toward zero (vLLM CPU's, over any FP8 dtype) is the largest magnitude of the dtype not above
    |x * (1/s)|, sign kept."""
    assert target.name not in fp8.TARGETS
    dtype = getattr(torch, target.dtype)
    grid = torch.arange(0, 0x80, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite() & (grid <= target.fp8_max)]  # every finite magnitude
    torch.manual_seed(0)
    big = target.fp8_max / 8
    x = torch.cat(
        [
            torch.randn(4000) * big,
            torch.randn(1000) * 1e-3,
            torch.tensor([0.0, target.fp8_max, -1e6, 1e-9]),
        ]
    )
    for scale in (1.0, 0.04345703125, 0.0625):
        got = fp8.fake_quantize(x, scale, target) / scale
        y = (x * (1.0 / torch.tensor(scale))).clamp(-target.fp8_max, target.fp8_max)
        expected = torch.sign(y) * grid[torch.searchsorted(grid, y.abs(), right=True) - 1]
        assert torch.allclose(got, expected, rtol=1e-6, atol=0), scale
    nearest = fp8.fake_quantize(x, 1.0, dataclasses.replace(target, toward_zero=False))
    assert (fp8.fake_quantize(x, 1.0, target).abs() <= nearest.abs()).all()
    assert (fp8.fake_quantize(x, 1.0, target) != nearest).any()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_toward_zero_in_float32_arithmetic_is_the_casts_to_the_bit(dtype):
    """A cast toward zero done in float32 bits (fp8._toward_zero: vLLM CPU's e4m3fn, what the objective runs on
    every candidate; e5m2 too), against the largest magnitude of the grid not above |x|: every code, the float32
    values on either side of each code and of each midpoint between codes, and the dtype's range at random (from
    below its smallest subnormal), both signs."""
    info = torch.finfo(dtype)
    grid = torch.arange(0, 0x80, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite()]
    mid = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    near = torch.cat([grid, mid])
    x = torch.cat([near, torch.nextafter(near, up), torch.nextafter(near, down)])
    low, high = math.log2(info.smallest_normal * info.eps / 8), math.log2(info.max)
    spread = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    x = torch.cat([x, 2.0 ** (low + spread * (high - low))])
    x = torch.cat([x, -x]).clamp(-info.max, info.max)
    got = fp8._toward_zero(x, dtype)
    expected = torch.sign(x) * grid[torch.searchsorted(grid, x.abs(), right=True) - 1]
    assert torch.equal(got.abs(), expected.abs()) and torch.equal(got.signbit(), x.signbit())


def test_bf16_reciprocal_check_needs_no_torch_and_agrees_with_it():
    """validate's bf16 check is pure Python (validate imports no torch); torch's casts are the reference."""
    import random

    import torch

    from kvcalib.core import fp8

    def with_torch(scale: float) -> bool:
        s = torch.tensor(scale, dtype=torch.float32).to(torch.bfloat16)
        if not torch.isfinite(s) or s == 0:
            return False
        r = (1.0 / s.float()).to(torch.bfloat16)
        return bool(torch.isfinite(r)) and bool(r != 0)

    rng = random.Random(0)
    values = [rng.choice((1, -1)) * 10 ** rng.uniform(-45, 45) for _ in range(20000)]
    values += [
        0.0,
        1e-38,
        1e-39,
        1e-40,
        2**-126,
        2**-133,
        2**-134,
        3.39e38,
        3.4e38,
        1e39,
        float("inf"),
        float("nan"),
    ]
    assert [fp8.bf16_reciprocal_ok(v) for v in values] == [with_torch(v) for v in values]


@pytest.mark.parametrize("target", ["trn2", "trn3", "gpu"])
def test_scale_from_absmax_is_element_by_element(target):
    """Every element of a tensor gets the scale it gets alone (the search asks for all its candidates at once)."""
    chip = fp8.get_target(target)
    torch.manual_seed(0)
    values = torch.cat(
        [
            torch.exp2(torch.empty(300).uniform_(-40, 40)),
            torch.tensor(
                [0.0, 1e-45, 1e-8, 239.9, 240.0, 448.0, 3.3e38, float("inf"), float("nan")]
            ),
        ]
    ).reshape(3, -1)
    together = fp8.scale_from_absmax(values, chip)
    alone = torch.stack(
        [fp8.scale_from_absmax(float(a), chip) for a in values.flatten().tolist()]
    ).reshape(3, -1)
    assert together.shape == values.shape and torch.equal(
        together.view(torch.int32), alone.view(torch.int32)
    )
