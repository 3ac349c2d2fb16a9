"""MXFP4 experts dequantised as transformers loads them (the rules, what is MXFP4 and where it serves, are
kvcalib.core.mxfp4's): from_pretrained gets `Mxfp4Config(dequantize=True)` with the config declaring
`{"quant_method": "mxfp4"}`, and the streamed engine that config's quantizer; either maps each `_blocks`/`_scales`
pair through transformers' `convert_moe_packed_tensors`, which kvcalib swaps for `dequantize`, the same values by
table (the internals: kvcalib.hf.internals)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.hf import internals

if TYPE_CHECKING:
    import torch

__all__ = ["dequantize", "dequantize_mxfp4", "expert_chunks"]


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, *, dtype: Any = None, per_chunk: int = 4, **_: Any
) -> torch.Tensor:
    """transformers' `convert_moe_packed_tensors` ([E, R, G, 16] uint8 codes, [E, R, G] exponents + 127 ->
    [E, G * 32, R]), bit for bit, by table: each byte's two values under each scale, worked out once by
    transformers' own arithmetic (65,536 pairs), then gathered `per_chunk` experts at a time straight into the
    result's memory. The result is transformers' layout as a transposed view of [E, R, G * 32] (what the experts'
    matmuls read as is, like a Linear weight), not a copy: the copy was most of a GPT-OSS-120B layer's load."""
    import torch

    dtype = dtype or torch.bfloat16
    pair = {2: torch.int32, 4: torch.int64}[dtype.itemsize]
    table = internals.mxfp4_table(dtype).to(blocks.device)
    table = table.T.contiguous().view(pair).reshape(-1)  # [scale << 8 | byte] -> the pair
    experts, rows, groups, width = blocks.shape
    out = torch.empty((experts, rows * groups * width), dtype=pair, device=blocks.device)
    for first in range(0, experts, per_chunk):
        last = min(first + per_chunk, experts)
        index = blocks[first:last].to(torch.int32)
        index.add_(scales[first:last].to(torch.int32).unsqueeze(-1) << 8)
        torch.index_select(table, 0, index.reshape(-1), out=out[first:last].view(-1))
    return out.view(dtype).reshape(experts, rows, groups * width * 2).transpose(1, 2)


@contextmanager
def expert_chunks(per_chunk: int = 4) -> Iterator[None]:
    """transformers' MXFP4 dequantisation, while loading, done by `dequantize` (`per_chunk` experts at a time):
    the same values, ~10x faster, a chunk's transient memory instead of twice a layer's experts (+8.5 GB for
    GPT-OSS-120B's gate_up alone)."""
    with internals.mxfp4_dequantizing(functools.partial(dequantize, per_chunk=per_chunk)):
        yield


def dequantize_mxfp4(
    model_dir: str | Path, output: str | Path, max_shard_size: str = "5GB"
) -> Path:
    """Write `model_dir` again with its experts dequantised to bf16 and no quantization_config (calibrate's GPU
    form); saved without the reverse weight conversion, with which transformers 5.17 writes names it cannot load.
    The experts load as transposed views (`dequantize`); saving copies each into a shard contiguously."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    internals.internal("modeling_utils", "PreTrainedModel.save_pretrained", "save_original_format")
    with expert_chunks():
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, quantization_config=Mxfp4Config(dequantize=True)
        )
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(output, max_shard_size=max_shard_size, save_original_format=False)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(output)
    return Path(output)
