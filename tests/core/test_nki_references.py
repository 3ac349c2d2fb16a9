"""kvcalib's Neuron numerics against reimplementations of AWS's own executable references (aws-neuron/nki-library at
092a49d, src/nkilib_src/nkilib/experimental/), written here from their text in the layouts they use: the packed
token-pair K cache and the unpacked V cache of attention/swa_fused_cte_torch.py, the swizzled [32, 160] MXFP8 blocks
and the decode step of attention_mxfp8/attention_mxfp8_tkg_torch.py. Where a reference is exact (its casts, its
divisions, its powers of two) kvcalib must give its bits; where it rounds a sum, within that rounding."""

from __future__ import annotations

import pytest
import torch

from kvcalib.core import fp8, mxfp8
from kvcalib.evaluation.emulate import mxfp8_decode_attention

E4M3FN = torch.float8_e4m3fn
TRN2 = fp8.get_target("trn2")


def _kv(shape, seed, spread=4.0):
    """bf16-valued K/V with a few large channels, as real models have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * spread
    x[..., :3] *= 20
    return x.to(torch.bfloat16).float()


# --- swa_fused_cte_torch.py: the packed FP8 write and the prior window's read -----------------------------------


def _swa_ref_write_k(k, scale, fp8_max):
    """`_quant_pack_cache` for one sequence's K [heads, tokens, d] (tokens even): bf16(x) / scale in float32,
    clipped, cast to E4M3FN; tokens 2i and 2i+1 side by side in a trailing axis of 2."""
    q = (k.to(torch.bfloat16).float() / torch.tensor(scale, dtype=torch.float32)).clamp(
        -fp8_max, fp8_max
    )
    return torch.stack([q[:, 0::2], q[:, 1::2]], dim=-1).to(E4M3FN)  # [heads, tokens/2, d, 2]


def _swa_ref_read_k(packed, scale):
    """`_unpack_dequant_cache`: the pairs back in token order, times the scale, in float32."""
    heads, half, d, _ = packed.shape
    tokens = torch.zeros(heads, 2 * half, d)
    tokens[:, 0::2], tokens[:, 1::2] = packed.float()[..., 0], packed.float()[..., 1]
    return tokens * torch.tensor(scale, dtype=torch.float32)


def _swa_ref_write_read_v(v, scale, fp8_max):
    """`_quant_cache_unpacked` then `_dequant_cache_unpacked`: V token-major, no pairing."""
    s = torch.tensor(scale, dtype=torch.float32)
    return (v.to(torch.bfloat16).float() / s).clamp(-fp8_max, fp8_max).to(E4M3FN).float() * s


def _plugin_write_scale(checkpoint_scale):
    """What the vLLM Neuron plugin hands swa_fused_cte, as its code computes it (jinhuang12/vllm-neuron at ed3580d,
    gpt_oss/model_mxfp4.py): `self.k_scale = 1.0 / s.to(bf16)` (a bf16 tensor), then `1.0 / self.k_scale`."""
    multiplier = 1.0 / torch.tensor([checkpoint_scale]).to(torch.bfloat16)
    return float(1.0 / multiplier)


@pytest.mark.parametrize("checkpoint_scale", [0.5, 1.5, 0.0123, 0.318, 3.7])
@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_the_prior_window_is_read_as_swa_fused_cte_writes_and_reads_it(checkpoint_scale, target):
    t = fp8.get_target(target)
    s = _plugin_write_scale(checkpoint_scale)
    assert fp8.swa_fused_cte_scale(checkpoint_scale).item() == s
    k, v = _kv((2, 128, 64), 0, 12 * checkpoint_scale), _kv((2, 128, 64), 1, 12 * checkpoint_scale)
    reference_k = _swa_ref_read_k(_swa_ref_write_k(k, s, t.fp8_max), s)
    assert torch.equal(fp8.swa_fused_cte_round_trip(k, checkpoint_scale, t), reference_k)
    assert torch.equal(
        fp8.swa_fused_cte_round_trip(v, checkpoint_scale, t), _swa_ref_write_read_v(v, s, t.fp8_max)
    )
    # some values saturate (the clamp is exercised), most do not
    assert 0 < int((k.abs() / s > t.fp8_max).sum()) < k.numel() // 10
    # bf16 K/V (the model's own dtype): the kernel dequantises the prior window to bf16
    assert torch.equal(
        fp8.swa_fused_cte_round_trip(k.to(torch.bfloat16), checkpoint_scale, t),
        reference_k.to(torch.bfloat16),
    )


def test_the_kernel_multiplies_by_its_reciprocal_where_the_reference_divides():
    """swa_fused_cte's kernel computes x * (1/s) with an on-chip float32 reciprocal; the reference divides. Exact
    reciprocals (powers of two) give the same bits; otherwise a value may land one FP8 step apart, rarely."""
    x = _kv((64, 1024), 2, 50.0)
    for s in (0.25, 2.0):
        assert torch.equal((x / s).to(E4M3FN), (x * (1 / torch.tensor(s))).to(E4M3FN))
    s = torch.tensor(0.318)
    divided, multiplied = (x / s).to(E4M3FN).float(), (x * (1 / s)).to(E4M3FN).float()
    apart = divided != multiplied
    assert apart.float().mean() < 1e-3
    step = (divided.abs().clamp(min=2**-6).log2().floor() - 3).exp2()  # E4M3FN's step at each value
    assert ((divided - multiplied).abs() <= step)[apart].all()


# --- attention_mxfp8_tkg_torch.py: the MXFP8 blocks and the decode step -------------------------------------------


def _ref_quantize_to_mx(data):
    """`quantize_to_mx` (core/utils/mx_torch_common.py) on [P, F] (P a multiple of 8, F of 4): one E8M0 per 8 rows x
    4 columns, the group's largest biased float32 exponent less 8 (clipped to 0..255); values over 2^(X-127),
    clipped to ±448, cast to E4M3FN. Returns (fp8 values as float32, E8M0 as int32 [P/8, F/4])."""
    p, f = data.shape
    exponent = (data.float().view(torch.int32) >> 23) & 0xFF
    x = (exponent.reshape(p // 8, 8, f // 4, 4).amax(dim=(1, 3)) - 8).clamp(0, 255)
    scale = torch.exp2((x - 127).float()).repeat_interleave(8, 0).repeat_interleave(4, 1)
    return (data.float() / scale).clamp(-448, 448).to(E4M3FN).float(), x


def _ref_round_trip_2d(data):
    """`mxfp8_round_trip_2d`: pad [P, F] to multiples of (8, 4), quantise, dequantise with the exponent clipped to
    ±127, unpad."""
    p, f = data.shape
    padded = torch.nn.functional.pad(data.float(), (0, -f % 4, 0, -p % 8))
    values, x = _ref_quantize_to_mx(padded)
    scale = torch.exp2((x - 127).clamp(-127, 127).float())
    return (values * scale.repeat_interleave(8, 0).repeat_interleave(4, 1))[:p, :f]


def _ref_block_round_trip(block, contraction):
    """A [128 tokens, 128] K or V block packed as the test harness packs it (V transposed first), swizzled [T, H] ->
    [H/4, T*4] (element (t, h) at partition h // 4, column 4t + h % 4), quantised in 8 x 4 groups, then
    `_unpack_mx_block`'s inverse: [128 tokens, 128] float32."""
    logical = block if contraction == "d_head" else block.T
    t, h = logical.shape
    swizzled = logical.reshape(t, h // 4, 4).permute(1, 0, 2).reshape(h // 4, t * 4)
    deq = _ref_round_trip_2d(swizzled)
    unswizzled = deq.reshape(h // 4, t, 4).permute(1, 0, 2).reshape(t, h)
    return unswizzled if contraction == "d_head" else unswizzled.T


def test_the_mxfp8_cache_blocks_are_the_references_swizzled_groups():
    """K's groups are 32 head-dim elements of a token, V's 32 tokens of a head-dim column: the reference's 8 x 4
    swizzled groups, to the bit."""
    for seed in range(3):
        k, v = _kv((128, 128), seed), _kv((128, 128), seed + 10)
        assert torch.equal(
            mxfp8.round_trip(k, {1: mxfp8.GROUP}), _ref_block_round_trip(k, "d_head")
        )
        assert torch.equal(
            mxfp8.round_trip(v, {0: mxfp8.GROUP}), _ref_block_round_trip(v, "block_len")
        )
    q = _kv((64, 128), 7) * 0.088
    assert torch.equal(mxfp8.round_trip(q, {0: 8, 1: 4}), _ref_round_trip_2d(q))
    zeros = torch.zeros(8, 4)
    assert torch.equal(mxfp8.round_trip(zeros, {0: 8, 1: 4}), zeros)


def _ref_decode_step(q, k_cache, v_cache, valid, k_active, v_active):
    """attention_mxfp8_tkg_torch_ref for one sequence and one KV head: q [H, d]; k_cache/v_cache [T, d] already
    through MXFP8; valid [T] bool. Q * (1/sqrt(d)) through MXFP8, per 2048-token chunk scores rounded to bf16 (masked
    -65504), online softmax with exp(scores - max) through MXFP8 before the V product, the active token last with the
    unquantised Q; the result cast to bf16."""
    d = q.shape[-1]
    q_scaled = q.float() * (1.0 / d**0.5)
    q_rt = _ref_round_trip_2d(q_scaled)
    heads = q.shape[0]
    running_max = torch.full((heads, 1), -1e38)
    running_sum, running_out = torch.zeros(heads, 1), torch.zeros(heads, d)
    for start in range(0, k_cache.shape[0], 2048):
        scores = q_rt @ k_cache[start : start + 2048].T
        scores = torch.where(valid[start : start + 2048], scores, torch.tensor(-65504.0))
        scores = scores.to(torch.bfloat16).float()
        top = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        correction = torch.exp(running_max - top)
        running_out, running_sum = running_out * correction, running_sum * correction
        e = torch.exp(scores - top)
        running_sum = running_sum + e.sum(-1, keepdim=True)
        running_out = running_out + _ref_round_trip_2d(e) @ v_cache[start : start + 2048]
        running_max = top
    new = q_scaled @ k_active.float()
    top = torch.maximum(running_max[:, 0], new)
    correction, e_new = torch.exp(running_max[:, 0] - top), torch.exp(new - top)
    running_out = running_out * correction[:, None] + e_new[:, None] * v_active.float()[None]
    running_sum = running_sum * correction[:, None] + e_new[:, None]
    return (running_out / running_sum).to(torch.bfloat16).float()


@pytest.mark.parametrize("length", [300, 2500])  # one chunk; two, the second partly masked
def test_mxfp8_decode_is_the_references_decode_step(length):
    """eval's MXFP8 decode (emulate.mxfp8_decode_attention) on the last position of a sequence against the
    reference's decode step over a cache written from the same K/V (the block as written whole: V's groups span 32
    tokens). 8 query heads on one KV head, head_dim 128, the kernel's shapes. The sums are float32 in both, added in
    another order: equal to bf16's rounding."""
    heads, d = 8, 128
    q = _kv((1, heads, 1, d), 20, 1.0)
    k, v = _kv((1, 1, length, d), 21), _kv((1, 1, length, d), 22, 1.0)
    ours = mxfp8_decode_attention(q, k, v, None, 1.0 / d**0.5)[0, 0]  # [H, d]
    padded = (-length) % mxfp8.GROUP
    k_cache = mxfp8.round_trip(k[0, 0], {1: mxfp8.GROUP})
    v_cache = mxfp8.round_trip(torch.nn.functional.pad(v[0, 0], (0, 0, 0, padded)), {0: 32})
    assert torch.equal(k_cache[:128], _ref_block_round_trip(k[0, 0, :128], "d_head"))
    valid = torch.arange(length) < length - 1  # the cache holds the tokens before this step
    theirs = _ref_decode_step(
        q[0, :, 0], k_cache, v_cache[:length], valid, k[0, 0, -1], v[0, 0, -1]
    )
    torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=1e-4)
    # and it differs from attention on the unquantised cache by far more than that: the emulation is not a no-op
    exact = torch.softmax(q[0, :, 0].float() @ k[0, 0].T.float() / d**0.5, -1) @ v[0, 0].float()
    assert (ours - exact).abs().max() > 100 * (ours - theirs).abs().max()
