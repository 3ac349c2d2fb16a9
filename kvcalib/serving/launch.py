"""How a vLLM server is launched: its command line, its environment, its KV cache size on CPU."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcalib.core.schema import kv_cache_size
from kvcalib.serving.options import ServeOptions

__all__ = [
    "baseline_kv_dtype",
    "cpu_kv_cache_bytes",
    "interpreter_path",
    "server_argv",
    "server_env",
]

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MIB = 1 << 20


def cpu_kv_cache_bytes(config: Mapping[str, Any], max_model_len: int, max_num_seqs: int) -> int:
    """A KV cache for max_num_seqs full-length sequences in bf16, twice over, at least 64 MiB (vLLM on CPU otherwise
    reserves a fraction of the machine's memory and refuses to start when that much is not free)."""
    size = kv_cache_size(dict(config))
    if size is None:
        return 1 << 30
    wanted = 2 * size.per_token["bf16"] * max_model_len * max_num_seqs
    return max(64 * MIB, -(-wanted // MIB) * MIB)


def baseline_kv_dtype(config: Mapping[str, Any]) -> str:
    """The baseline's KV dtype: the model's own 16-bit type (float32 models get bfloat16)."""
    dtype = config.get("dtype") or config.get("torch_dtype")
    return "float16" if dtype == "float16" else "bfloat16"


def server_argv(
    options: ServeOptions,
    checkpoint: Path,
    port: int,
    fp8: bool,
    tp: int = 1,
    config: Mapping[str, Any] | None = None,
    neuron_quantization: str | None = None,
) -> list[str]:
    """The vLLM command line for --vllm-python, --device, --max-model-len and --max-num-seqs: the same for both
    servers except `--kv-cache-dtype` (the baseline's from `config`, the checkpoint's config.json).
    `neuron_quantization`: the neuron_config quantization to name (GPT-OSS with MXFP4 experts: "bf16" on trn2,
    "mxfp4" on trn3)."""
    device, max_model_len = options.device, options.max_model_len
    # Neuron's FP8 prefill reads a packed KV cache (a whole prompt in one batch) and it samples
    # on the host (no async scheduling); vLLM CPU is served the same. GPU vLLM needs neither.
    packed = device != "cuda"
    argv = [
        str(options.vllm_python),
        "-m",
        API_SERVER_MODULE,
        "--model",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp),
        "--max-model-len",
        str(max_model_len),
        *(("--max-num-batched-tokens", str(max_model_len)) if packed else ()),
        "--max-num-seqs",
        str(options.max_num_seqs),
        "--no-enable-prefix-caching",
        *(("--no-async-scheduling",) if packed else ()),
        # The baseline names its KV dtype: with "auto", vLLM (CPU and GPU) turns FP8 on by itself when
        # the checkpoint's quantization_config has a kv_cache_scheme, as ours does.
        "--kv-cache-dtype",
        "fp8" if fp8 else baseline_kv_dtype(config or {}),
    ]
    if neuron_quantization is not None:
        argv += [
            "--additional-config",
            json.dumps({"neuron_config": {"quantization": neuron_quantization}}),
        ]
    if device == "cpu":
        kv_bytes = cpu_kv_cache_bytes(config or {}, max_model_len, options.max_num_seqs)
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes)]
    return argv


def server_env(
    argv: Sequence[str], env: Mapping[str, str], cache_dir: Path, neuron_visible_devices: str | None
) -> tuple[dict[str, str], str]:
    """(the server's environment: caches off the home directory, offline; the command line to print, with the
    variables serve-check set)."""
    defaults = {
        "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
        "VLLM_CONFIG_ROOT": str(cache_dir / "vllm-config"),
        "MPLCONFIGDIR": str(cache_dir / "matplotlib"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    added = {key: value for key, value in defaults.items() if key not in env}
    if neuron_visible_devices:
        added["NEURON_VISIBLE_DEVICES"] = neuron_visible_devices
    command = " ".join([f"{k}={shlex.quote(v)}" for k, v in added.items()] + [shlex.join(argv)])
    return {**env, **added}, command


def interpreter_path(python: Path, path_env: str | None) -> Path:
    """An absolute path for --vllm-python (servers run in the log directory), symlinks kept: a venv's
    python is a symlink whose target is the base interpreter, without the venv's packages."""
    found = None if os.sep in str(python) else shutil.which(str(python), path=path_env)
    return Path(found or os.path.abspath(python))
