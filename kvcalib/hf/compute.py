"""bf16 at float32 speed (kvcalib.core.cpu decides when): `bf16_via_float32()` runs `F.linear`, matmuls, SDPA and
MoE grouped_mm on bf16 inputs (upcast exactly) with float32 accumulation, rounded once to bf16; other ops stay bf16.
A weight is upcast only for the call, in row blocks, unless a `Float32Weights` keeps float32 copies."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvcalib.core.cpu import ComputePath

__all__ = [
    "FLOAT32_WEIGHTS_BUDGET",
    "SDPA_QUERY_BLOCK",
    "UPCAST_BLOCK_ELEMENTS",
    "Float32Weights",
    "bf16_via_float32",
    "compute_path",
]

# A weight is upcast for one call in row blocks of at most this many elements (64 MiB in float32).
UPCAST_BLOCK_ELEMENTS = 16 << 20
# Float32Weights' default budget: every weight of a model up to ~1.5B parameters.
FLOAT32_WEIGHTS_BUDGET = 6 << 30


class Float32Weights:
    """float32 copies (exact) of a bf16 model's parameters, made at first use and kept up to `budget` bytes."""

    def __init__(self, budget: int = FLOAT32_WEIGHTS_BUDGET) -> None:
        self.budget, self.used = budget, 0
        # id -> (the parameter, its copy)
        self._copies = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The float32 copy of `weight` (a bf16 nn.Parameter), made now if the budget allows; else None."""
        entry = self._copies.get(id(weight))
        if entry is not None and entry[0] is weight:
            return entry[1]
        size = weight.numel() * 4
        if not isinstance(weight, torch.nn.Parameter) or self.used + size > self.budget:
            return None
        copy = weight.detach().float()
        self._copies[id(weight)] = (weight, copy)
        self.used += size
        return copy


def _up(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_up(a) for a in x)
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weights: Float32Weights | None = None,
) -> torch.Tensor:
    """F.linear with bf16 inputs in float32, the weight taken from `weights` or upcast in row blocks."""
    kept = None if weights is None or weight.dtype != torch.bfloat16 else weights.get(weight)
    xf, weight = x.float(), weight if kept is None else kept
    rows = (
        len(weight)
        if kept is not None
        else max(1, UPCAST_BLOCK_ELEMENTS // max(1, weight.shape[-1]))
    )
    blocks = [
        torch.nn.functional.linear(
            xf,
            weight[i : i + rows].float(),
            None if bias is None else _up(bias[i : i + rows]),
        ).to(torch.bfloat16)
        for i in range(0, len(weight), rows)
    ]
    return torch.cat(blocks, dim=-1)


# Query rows per block of the emulated attention: bounds its float32 scores to [B, H, 64, S], and a causal block
# leaves out the columns after its last row (about half of a prefill's scores).
SDPA_QUERY_BLOCK = 64


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA on bf16 inputs as torch's CPU flash-attention kernel rounds: float32 scores, exp and sum, the exps in
    bf16 for the product with V (float32 accumulation), the output rounded to bf16 once; no dropout (eval only).
    Each query block reads only the key columns [lo, hi) outside which its every row is masked."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    kf_t, vf, blocks = key.float().transpose(-1, -2), value.float(), []
    for start in range(0, q_len, SDPA_QUERY_BLOCK):
        stop, mask = min(q_len, start + SDPA_QUERY_BLOCK), attn_mask
        if is_causal:  # torch's: each row reads the keys up to its own index
            mask = torch.arange(kv_len, device=query.device) <= torch.arange(
                start, stop, device=query.device
            ).unsqueeze(1)
        elif mask is not None and mask.shape[-2] == q_len:
            mask = mask[..., start:stop, :]
        lo, hi = 0, kv_len
        if mask is not None and mask.shape[-1] == kv_len:
            allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
            columns = allowed.reshape(-1, kv_len).any(dim=0).nonzero()
            if columns.numel():
                lo, hi = int(columns[0]), int(columns[-1]) + 1
        # [B, H, q, hi - lo] float32, worked on in place from here on
        scores = torch.matmul(query[..., start:stop, :].float(), kf_t[..., lo:hi])
        scores.mul_(query.shape[-1] ** -0.5 if scale is None else scale)
        if mask is not None:
            mask = mask[..., lo:hi]
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, float("-inf"))
            else:
                scores.add_(mask.float())
        # a fully masked row: zeros
        exp = scores.sub_(scores.amax(dim=-1, keepdim=True).nan_to_num_(neginf=0.0)).exp_()
        total = exp.sum(dim=-1, keepdim=True)
        out = torch.matmul(exp.to(torch.bfloat16).float(), vf[..., lo:hi, :]).div_(total)
        blocks.append(out.nan_to_num_(nan=0.0).to(torch.bfloat16))
    return torch.cat(blocks, dim=-2)


_F = torch.nn.functional
_UPCAST_OPS = frozenset(
    {
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
    }
)


class _Bf16ViaFloat32(TorchFunctionMode):
    def __init__(self, weights: Float32Weights | None = None) -> None:
        super().__init__()
        self.weights = weights

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _F.linear and _any_bf16(args[:1]):
            return _linear(*args, **kwargs, weights=self.weights)
        if func is _F.scaled_dot_product_attention and _any_bf16(args[:3]):
            return _sdpa(*args, **kwargs)
        if func in _GROUPED_MM and _any_bf16(args[:2]):
            out = _grouped_mm(*args, **kwargs)
            if out is not None:
                return out
        if func in _UPCAST_OPS and _any_bf16(args):
            out = func(*(_up(a) for a in args), **{k: _up(v) for k, v in kwargs.items()})
            return (
                out.to(torch.bfloat16)
                if isinstance(out, torch.Tensor) and out.is_floating_point()
                else out
            )
        return func(*args, **kwargs)


# F.grouped_mm reaches a torch function mode as torch._grouped_mm(mat_a, mat_b, offs, bias, out_dtype)
_GROUPED_MM = frozenset(
    f for f in (getattr(torch, "_grouped_mm", None), getattr(_F, "grouped_mm", None)) if f
)


def _grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: Any = None,
    bias: Any = None,
    out_dtype: Any = None,
) -> torch.Tensor | None:
    """Each expert's rows times its own weight, upcast alone, in float32, rounded to bf16 once; None where grouped_mm
    is not called as MoE experts call it (transformers.integrations.moe): that runs as it is."""
    if (
        offs is None
        or bias is not None
        or out_dtype not in (None, torch.bfloat16)
        or (mat_a.dim(), mat_b.dim()) != (2, 3)
    ):
        return None
    out, start = mat_a.new_zeros((mat_a.shape[0], mat_b.shape[-1]), dtype=torch.bfloat16), 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = (mat_a[start:end].float() @ mat_b[expert].float()).to(torch.bfloat16)
        start = end
    return out


def _any_bf16(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)


bf16_via_float32 = _Bf16ViaFloat32


def compute_path(
    path: ComputePath, weights: Float32Weights | None = None
) -> AbstractContextManager[Any]:
    return bf16_via_float32(weights) if path.emulated else nullcontext()
