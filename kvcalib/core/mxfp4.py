"""MXFP4 experts (GPT-OSS as released, and kvcalib's Neuron form of it): `<experts>.gate_up_proj_blocks` (FP4
codes) beside `..._scales` (exponents), the same for down_proj. Calibrated as they are (transformers dequantizes them
on load); the output keeps them, linked, under a KV-only config. Neuron reads them by name: jinhuang12/vllm-neuron at
ed3580d, vllm_neuron/model/gpt_oss/factory.py picks model_bf16.py or model_mxfp4.py by neuron_config quantization,
else by chip (trn3 mxfp4), and refuses mxfp4 on trn2; vllm-project/vllm-neuron at b8834a3,
docs/model-recipes/gpt-oss.md serves the released checkpoint on trn2 with its quantization_config emptied. GPU vLLM
(0.32) gives attention no quant method under its MXFP4 config (vllm/model_executor/layers/quantization/mxfp4.py,
Mxfp4Config.get_quant_method): FP8 KV runs at 1.0, so --target gpu is refused (`dequantize_mxfp4` makes a bf16 form).

transformers 5.17.0 internals used (imported inside the functions): `Mxfp4Config(dequantize=True)` with a config
declaring `{"quant_method": "mxfp4"}`; `quantizers.auto.AutoHfQuantizer.from_config(..., pre_quantized=True)`, whose
`get_weight_conversions` (quantizers/quantizer_mxfp4.py) maps the pairs through `integrations.mxfp4.Mxfp4Dequantize`
(the stream engine passes it to `conversion_mapping.get_model_conversion_mapping` and
`modeling_utils.LoadStateDictConfig`); `integrations.mxfp4.convert_moe_packed_tensors` (what `dequantize_convertops`
calls), swapped while loading for `dequantize`, whose table `_convert_moe_packed_tensors` computes;
`save_pretrained(save_original_format=False)` with `model.hf_quantizer = None`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.errors import UnsupportedModelError, UsageError
from kvcalib.core.fp8 import TARGETS, Target, get_target

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCKS",
    "DEQUANTIZE_COMMAND",
    "SCALES",
    "TRN2_CAUSE",
    "check_calibration",
    "dequantize",
    "dequantize_mxfp4",
    "dequantized_on_load",
    "dequantizer",
    "expert_chunks",
    "findings",
    "weights",
]

BLOCKS, SCALES = "_blocks", "_scales"
DEQUANTIZE_COMMAND = "python -c \"import kvcalib; kvcalib.dequantize_mxfp4('MODEL', 'BF16_DIR')\""
TRN2_CAUSE = (
    r"quantization='mxfp4' is not supported on TRN2",
    "vLLM-Neuron's GPT-OSS runs MXFP4 experts as MXFP4 only on trn3 (vllm_neuron/model/gpt_oss/factory.py)",
    (
        'on trn2 serve with --additional-config \'{"neuron_config": {"quantization": "bf16"}}\' '
        "(kvcalib's model card and serve-check pass it)"
    ),
)


def weights(keys: Iterable[str]) -> list[str]:
    """The weights stored as MXFP4 (a `<name>_blocks` and `<name>_scales` pair) among tensor keys: their names."""
    keys = set(keys)
    return sorted(
        k.removesuffix(BLOCKS)
        for k in keys
        if k.endswith(BLOCKS) and k.removesuffix(BLOCKS) + SCALES in keys
    )


def neuron_quantization(target: str) -> str | None:
    """The neuron_config quantization GPT-OSS needs on a Neuron `target`: mxfp4 on trn3, bf16 on trn2."""
    chip = TARGETS.get(target)
    return None if chip is None or not chip.neuron else "mxfp4" if chip.mxfp4 else "bf16"


def check_calibration(checkpoint: Checkpoint, target: Target, engine: str) -> dict[str, Any]:
    """calibrate's MXFP4 rules (GPU and llm-compressor refused); what the provenance records of them."""
    names = weights(checkpoint.files.key_files)
    if not names:
        return {}
    if not target.neuron:
        raise UnsupportedModelError(
            f"{checkpoint.root}: the experts are MXFP4: GPU vLLM's MXFP4 support loads no KV scales (Mxfp4Config "
            "gives attention no quantization method), so FP8 KV would run at scale 1.0 whatever kvcalib writes",
            hint=f"for GPU, dequantize the experts to bf16 first and calibrate that checkpoint: {DEQUANTIZE_COMMAND}; "
            "for Neuron (--target trn2 or trn3) calibrate the MXFP4 checkpoint as it is",
        )
    if engine == "llmcompressor":
        raise UsageError(
            "--engine llmcompressor does not dequantise MXFP4 experts; kvcalib's engines do",
            hint="drop --engine llmcompressor (native, or stream for models larger than memory)",
        )
    return {
        "mxfp4_weights": len(names),
        "source_quantization_config": checkpoint.config.get("quantization_config"),
    }


def findings(
    config: dict[str, Any], keys: Iterable[str], target: str
) -> list[tuple[str, str, str, str, str]]:
    """validate's MXFP4 rules as Finding fields: CKPT-MXFP4-PAIR, PORT-MXFP4-GPU, PORT-MXFP4-NEURON."""
    keys = set(keys)
    names = weights(keys)
    orphans = sorted(
        k
        for k in keys
        if k.endswith((BLOCKS, SCALES)) and "experts" in k and k.rsplit("_", 1)[0] not in names
    )
    found = [
        (
            "CKPT-MXFP4-PAIR",
            "error",
            f"{key}: an MXFP4 tensor without its other half (`_blocks` and `_scales` "
            "come in pairs): no loader can dequantise it",
            "restore the weight files from the released checkpoint",
            key,
        )
        for key in orphans[:3]
    ]
    qcfg = config.get("quantization_config")
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if names and not get_target(target).neuron:
        found.append(
            (
                "PORT-MXFP4-GPU",
                "error",
                f"{len(names)} expert weights are MXFP4 ({names[0]}_blocks, ...): GPU vLLM reads them only under its "
                "MXFP4 config, which loads no KV scales (FP8 KV at scale 1.0)"
                + (
                    ""
                    if method == "mxfp4"
                    else f", and under this {method or 'missing'} config it cannot load them"
                ),
                f"calibrate the dequantised form for GPU: {DEQUANTIZE_COMMAND}, "
                "then kvcalib calibrate BF16_DIR --target gpu",
                "config.json:quantization_config",
            )
        )
    elif names and method != "mxfp4":  # kvcalib's Neuron form
        quantization = neuron_quantization(target)
        found.append(
            (
                "PORT-MXFP4-NEURON",
                "info",
                f"{len(names)} expert weights are MXFP4, kept as released: Neuron's GPT-OSS model reads them by name "
                f"(on {target}: neuron_config quantization {quantization!r})",
                f'serve with --kv-cache-dtype fp8 --additional-config \'{{"neuron_config": {{"quantization": '
                f"\"{quantization}\"}}}}' (the model card's command)",
                "config.json:quantization_config",
            )
        )
    return found


def dequantizer(keys: Iterable[str]) -> Any:
    """transformers' MXFP4 quantizer, set to dequantize as they load; None without MXFP4 weights."""
    if not weights(keys):
        return None
    from transformers import Mxfp4Config
    from transformers.quantizers.auto import AutoHfQuantizer

    return AutoHfQuantizer.from_config(Mxfp4Config(dequantize=True), pre_quantized=True)


@contextmanager
def dequantized_on_load(keys: Iterable[str], config: Any) -> Iterator[dict[str, Any]]:
    """from_pretrained's extra arguments: with MXFP4 weights, `config` declares them and they dequantize on load."""
    if not weights(keys):
        yield {}
        return
    from transformers import Mxfp4Config

    config.quantization_config = {"quant_method": "mxfp4"}
    with expert_chunks():
        yield {"quantization_config": Mxfp4Config(dequantize=True)}


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, *, dtype: Any = None, per_chunk: int = 4, **_: Any
) -> torch.Tensor:
    """transformers' `convert_moe_packed_tensors` ([E, R, G, 16] uint8 codes, [E, R, G] exponents + 127 ->
    [E, G * 32, R]), bit for bit, by table: each byte's two values under each scale, worked out once by
    transformers' own arithmetic (65,536 pairs), then gathered `per_chunk` experts at a time straight into the
    result's memory. The result is transformers' layout as a transposed view of [E, R, G * 32] (what the experts'
    matmuls read as is, like a Linear weight), not a copy: the copy was most of a GPT-OSS-120B layer's load."""
    import torch
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    dtype = dtype or torch.bfloat16
    pair = {2: torch.int32, 4: torch.int64}[dtype.itemsize]
    byte = torch.arange(256, dtype=torch.uint8, device=blocks.device)
    table = _convert_moe_packed_tensors(  # [1, 512, scale]: byte b's values at rows 2b, 2b + 1
        byte.expand(256, 256).reshape(1, 256, 1, 256), byte.reshape(1, 256, 1), dtype=dtype
    )
    table = table[0].T.contiguous().view(pair).reshape(-1)  # [scale << 8 | byte] -> the pair
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
    GPT-OSS-120B's gate_up alone). Blocks other than [E, R, G, 16] go to transformers' own."""
    import torch
    from transformers.integrations import mxfp4 as integration

    original = integration.convert_moe_packed_tensors

    def by_table(blocks: torch.Tensor, scales: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if blocks.dim() != 4 or kwargs.get("dtype", torch.bfloat16).itemsize not in (2, 4):
            return original(blocks, scales, **kwargs)
        return dequantize(blocks, scales, per_chunk=per_chunk, **kwargs)

    integration.convert_moe_packed_tensors = by_table
    try:
        yield
    finally:
        integration.convert_moe_packed_tensors = original


def dequantize_mxfp4(
    model_dir: str | Path, output: str | Path, max_shard_size: str = "5GB"
) -> Path:
    """Write `model_dir` again with its experts dequantised to bf16 and no quantization_config (calibrate's GPU
    form); saved without the reverse weight conversion, with which transformers 5.17 writes names it cannot load.
    The experts load as transposed views (`dequantize`); saving copies each into a shard contiguously."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    with expert_chunks():
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, quantization_config=Mxfp4Config(dequantize=True)
        )
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(output, max_shard_size=max_shard_size, save_original_format=False)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(output)
    return Path(output)
