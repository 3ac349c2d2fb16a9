"""bf16 at float32 speed: a bf16 model's matmuls and attention computed in float32, rounded as bf16 rounds.

`bf16_via_float32()` runs a bf16 model's `F.linear`, matmuls and SDPA in float32, rounding
to bf16 exactly where the bf16 model rounds: bf16 inputs (upcast exactly), float32
accumulation, the result rounded once to bf16. Every other op (norms, rotary embedding,
activations, the K/V kvcalib records) stays the bf16 model's own. Weights stay in memory
at their stored size; a weight is upcast only for the call that uses it, in row blocks of
at most `UPCAST_BLOCK_ELEMENTS`. kvcalib.core.cpu decides when (CPUs without native bf16).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvcalib.core.cpu import ComputePath

__all__ = ["SDPA_QUERY_BLOCK", "UPCAST_BLOCK_ELEMENTS", "bf16_via_float32", "compute_path"]

# A weight is upcast for one call in row blocks of at most this many elements (64 MiB in float32).
UPCAST_BLOCK_ELEMENTS = 16 << 20


@contextmanager
def compute_path(path: ComputePath) -> Iterator[None]:
    """Run the block on `path`: bf16_via_float32() when emulated, as is otherwise."""
    if not path.emulated:
        yield
        return
    with bf16_via_float32():
        yield


def bf16_via_float32() -> TorchFunctionMode:
    """A torch function mode: bf16 matmuls and attention computed in float32, rounded to bf16 once."""
    return _Bf16ViaFloat32()


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with bf16 inputs in float32, the weight upcast in row blocks (no float32 copy of it kept)."""
    xf = x.float()
    rows = max(1, UPCAST_BLOCK_ELEMENTS // max(1, weight.shape[-1]))
    if weight.shape[0] <= rows:
        return torch.nn.functional.linear(xf, weight.float(), _up(bias)).to(torch.bfloat16)
    parts = [
        torch.nn.functional.linear(xf, weight[i:i + rows].float(), None if bias is None else bias[i:i + rows].float())
        .to(torch.bfloat16)
        for i in range(0, weight.shape[0], rows)
    ]
    return torch.cat(parts, dim=-1)


# Query rows per block of the emulated attention: bounds its float32 scores to [B, H, 256, S].
SDPA_QUERY_BLOCK = 256


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """SDPA on bf16 inputs as torch's CPU flash-attention kernel computes it, with float32 matmuls.

    That kernel forms the scores in float32, takes exp(score - row max) in float32, sums it in
    float32, rounds the exponentials to bf16 for the product with V (float32 accumulation),
    divides by the sum and rounds the output to bf16 once. Copying those roundings keeps the
    emulated hidden states (and so the next layers' K/V) closest to the native bf16 model's.
    """
    if dropout_p:
        raise ValueError("kvcalib's float32 attention does not implement dropout")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q_len, kv_len = query.shape[-2], key.shape[-2]
    kf_t, vf = key.float().transpose(-1, -2), value.float()
    blocks = []
    for start in range(0, q_len, SDPA_QUERY_BLOCK):
        stop = min(q_len, start + SDPA_QUERY_BLOCK)
        scores = (query[..., start:stop, :].float() @ kf_t) * scale  # [B, H, q, kv] float32
        if is_causal:
            rows = torch.arange(start, stop, device=query.device)[:, None]
            scores = scores.masked_fill(torch.arange(kv_len, device=query.device)[None, :] > rows, float("-inf"))
        if attn_mask is not None:
            block_mask = attn_mask[..., start:stop, :] if attn_mask.shape[-2] == q_len else attn_mask
            scores = (scores.masked_fill(~block_mask, float("-inf")) if block_mask.dtype == torch.bool
                      else scores + block_mask.float())
        row_max = scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)  # a fully masked row: zeros
        exp = torch.exp(scores - row_max)
        total = exp.sum(dim=-1, keepdim=True)
        out = (exp.to(torch.bfloat16).float() @ vf) / total
        blocks.append(out.nan_to_num(nan=0.0).to(torch.bfloat16))
    return torch.cat(blocks, dim=-2)


_F = torch.nn.functional
_UPCAST_OPS = frozenset({
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
    torch.Tensor.bmm, torch.addmm, torch.baddbmm, torch.einsum,
})


class _Bf16ViaFloat32(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _F.linear and args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bfloat16:
            return _linear(*args, **kwargs)
        if func is _F.scaled_dot_product_attention and _any_bf16(args[:3]):
            return _sdpa(*args, **kwargs)
        if func in _UPCAST_OPS and _any_bf16(args):
            out = func(*(_up_all(a) for a in args), **{k: _up_all(v) for k, v in kwargs.items()})
            return out.to(torch.bfloat16) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
        return func(*args, **kwargs)


def _any_bf16(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)


def _up_all(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_up(a) for a in x)
    return _up(x)
