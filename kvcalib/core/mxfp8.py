"""MXFP8 as Trainium 3's block KV cache holds it: E4M3FN values, one E8M0 (power-of-two) scale per 32 consecutive
elements along the axis a matmul reduces over, and no per-tensor scale at all.

It follows AWS's executable reference, aws-neuron/nki-library at 092a49d,
src/nkilib_src/nkilib/experimental/attention_mxfp8/attention_mxfp8_tkg_torch.py (`_unpack_mx_block`,
`mxfp8_round_trip_2d`) and the quantiser it calls (core/utils/mx_torch_common.py, `quantize_to_mx`): a group's scale
is 2^(e - 8), e the largest biased float32 exponent in the group (OCP MX's sample rule: no rounding of the max),
values divided by it, clipped to ±448, cast to E4M3FN to nearest even. A K block's groups are 32 head-dim elements
of one token; a V block's, 32 consecutive tokens of one head-dim column (the reference's 8 x 4 swizzled groups;
tests/core/test_nki_references.py checks the two layouts give the same bits). Neuron 2.32's `nki.isa.quantize_mx`
documents a scale twice as large on the chip itself; the reference's rule is the one kvcalib emulates."""

from __future__ import annotations

import torch

__all__ = ["GROUP", "MX_MAX", "round_trip"]

GROUP = 32  # elements per E8M0 scale, along the reduced axis
MX_MAX = 448.0  # E4M3FN's largest finite value; the quantiser saturates there
_E4M3_EMAX = 8  # float32 exponent of MX_MAX's binade (2^8 = 256 <= 448 < 512)


def round_trip(x: torch.Tensor, groups: dict[int, int]) -> torch.Tensor:
    """`x` through MXFP8 and back, in float32, one scale per group of `groups` ({dim: elements along it}): the K/V
    cache's {reduced dim: GROUP}, or the reference's 8 x 4 for Q and the probabilities; a dim not a multiple of its
    group is zero-padded as the reference pads. An all-zero group's scale is 2^-127 (the reference clips there)."""
    groups = {d % x.dim(): n for d, n in groups.items()}
    pad = [0] * (2 * x.dim())
    for d, n in groups.items():
        pad[2 * (x.dim() - 1 - d) + 1] = -x.shape[d] % n
    split = torch.nn.functional.pad(x.float(), pad)
    shape = split.shape
    for d in sorted(groups, reverse=True):
        split = split.unflatten(d, (-1, groups[d]))
    inner = [d + i + 1 for i, d in enumerate(sorted(groups))]
    exponent = (
        split.view(torch.int32) >> 23
    ) & 0xFF  # biased; the sign bit shifted out by the mask
    shared = torch.clamp(exponent.amax(dim=inner, keepdim=True) - 127 - _E4M3_EMAX, min=-127)
    scale = torch.exp2(shared.float())
    q = (split / scale).clamp(-MX_MAX, MX_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(shape)[tuple(slice(n) for n in x.shape)]
