"""A fake `python -m vllm.entrypoints.openai.api_server` that behaves like vLLM 0.32 where it matters.

For tests on machines without vLLM or a Neuron device. Standard library only. It:
- parses the real flags (an unknown flag or a bad --kv-cache-dtype is refused with argparse's
  real message and exit 2), and refuses what the real platforms refuse, in their words:
  CPU: FP8 KV needs AVX-512/AMX (flags from $FAKE_VLLM_CPU_FLAGS, default "avx512f") and a head
  size divisible by 32; Neuron (when the `vllm_neuron` package is importable): the platform's
  quantization-config validator, unsupported KV dtypes, FP8 KV with segmented prefill (prefix
  caching on, or max-num-batched-tokens < max-model-len), a 0-d KV scale, and for GPT-OSS the plugin's own
  model choice and weight and scale loading (the fake plugin's vllm_neuron/gpt_oss.py). Two Neuron refusals
  have no public text we could find, so their wording is ours: --enforce-eager, and async
  scheduling without on-device sampling;
- like vLLM on CPU, turns FP8 KV on by itself for "auto" when config.json has a kv_cache_scheme;
- forks an "engine core" child in its own process group, as vLLM does, so a caller that only
  kills the leader leaves a process behind;
- answers GET /health only after $FAKE_VLLM_HEALTH_DELAY seconds (default 1), then serves
  /v1/models and /v1/completions (greedy text, return_token_ids, prompt_logprobs, token-id
  prompts, batches of prompts, OpenAI's echo + logprobs as lm-eval asks for them, 404 for an
  unknown model).

$FAKE_VLLM_MODE breaks servers whose KV cache is FP8 (the baseline stays healthy):
  crash           exit 1 while starting, with the Neuron loader's 0-d scale IndexError
  crash-unknown   exit 1 while starting, with an error no one recognises
  oom             exit 1 while starting, with vLLM CPU's memory-reservation ValueError
  hang            never becomes healthy
  die-mid-probe   the engine dies on the second completion request
  degenerate      every completion is one token repeated
  repetitive      every server, the baseline too, repeats one token (a small base model can)
  diverge         FP8 ranks the baseline's tokens second (agreement 0) and its NLL is worse
  ignore-scales   FP8 answers the same whatever the checkpoint's KV scales (the bug the canary exists for)
  inverted-scales FP8 applies the scales the wrong way round: larger scales clip (scale x64 is "right")
  forget-long     FP8 loses a passkey more than LONG_PROMPT tokens back (the long-context failure of a backend
                  whose FP8 attention is wrong only at length; short prompts stay right)
A prompt that holds "The pass key is N." and ends asking for it is answered with the key, as a model
that retrieves does; a prompt longer than --max-model-len gets vLLM's HTTP 400 for it.
Otherwise an FP8 server honours the scales: the fraction of each layer's K/V range that saturates
(the provenance's absmax against scale x FP8 max: 448 on CPU, 240 on Neuron) costs log-prob, and
above half of it the answers diverge, as a real model's do.
$FAKE_VLLM_IGNORE_SIGTERM=1 makes the server and its child ignore SIGTERM (only SIGKILL works).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KV_CACHE_DTYPES = [
    "auto",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_ds_mla",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_per_token_head",
    "int4_per_token_head",
    "int8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
    "nvfp4_ds_mla",
    "turboquant_3bit_nc",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_k8v4",
    "ultraquant_4bit",
]
NEURON_KV_CACHE_DTYPES = {"float32", "float16", "bfloat16", "fp8", "fp8_e4m3"}
MODE = os.environ.get("FAKE_VLLM_MODE", "")
PID = os.getpid()
CONTINUATIONS = {
    "The capital of France is": " Paris. It is known for the Eiffel Tower and its museums along the river",
    "One, two, three, four, five,": " six, seven, eight, nine, ten, eleven, twelve, thirteen and fourteen",
}
GENERIC = " and then the story went on with new words every time it was told to a friend"
LONG_PROMPT = 256  # tokens (the fake's: words and spaces)


def log(message: str, level: str = "INFO") -> None:
    print(
        f"(APIServer pid={PID}) {level} {time.strftime('%m-%d %H:%M:%S')} [fake_api_server.py] {message}",
        flush=True,
    )


def fail(exc_type: str, message: str) -> None:
    print(
        'Traceback (most recent call last):\n  File "<frozen runpy>", line 198, in _run_module_as_main\n'
        '  File "vllm/entrypoints/openai/api_server.py", line 59, in <module>',
        flush=True,
    )
    print(f"{exc_type}: {message}", flush=True)
    sys.exit(1)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="api_server.py")
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--kv-cache-memory-bytes", default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--additional-config", type=json.loads, default={})
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def kv_scale_entries(model: Path):
    """(open file, data start, key, header entry) of every *k_scale / *v_scale tensor in the checkpoint."""
    for file in sorted(model.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            for key, entry in header.items():
                if key.endswith(("k_scale", "v_scale")) and isinstance(entry, dict):
                    yield f, 8 + n, key, entry


def read_kv_scale_shapes(model: Path) -> dict[str, list[int]]:
    """Shapes of every *k_scale / *v_scale tensor in the checkpoint's safetensors headers."""
    return {key: entry.get("shape", []) for _f, _start, key, entry in kv_scale_entries(model)}


def resolve_kv_dtype(args: argparse.Namespace, config: dict, neuron: bool) -> str:
    quant = config.get("quantization_config") or {}
    if args.kv_cache_dtype == "auto" and not neuron and quant.get("kv_cache_scheme"):
        return "fp8"  # vLLM on CPU/GPU honours the checkpoint's kv_cache_scheme; Neuron does not
    return args.kv_cache_dtype


def check_neuron(args: argparse.Namespace, config: dict, kv_dtype: str) -> dict[str, float] | None:
    """The Neuron platform's refusals, then the model's load; the KV scales the kernels run with where the model
    is one the fake plugin follows (GPT-OSS), else None (every *k_scale / *v_scale in the files is read)."""
    from vllm_neuron.platform import platform_target, validate_quantization_config

    neuron_config = (args.additional_config or {}).get("neuron_config") or {}
    try:
        validate_quantization_config(config.get("quantization_config"), neuron_config)
    except ValueError as exc:
        fail("ValueError", str(exc))
    if kv_dtype not in NEURON_KV_CACHE_DTYPES and kv_dtype != "auto":
        fail(
            "ValueError",
            f"Unsupported kv_cache_dtype '{kv_dtype}' on Neuron. "
            f"Supported values: 'auto', {sorted(NEURON_KV_CACHE_DTYPES)}",
        )
    if args.enforce_eager:
        fail(
            "ValueError",
            "enforce_eager is not supported on the Neuron platform: eager mode is CPU-only.",
        )
    if (
        args.async_scheduling is not False
        and neuron_config.get("on_device_sampling_config") is None
    ):
        fail(
            "ValueError",
            "Async scheduling requires on-device sampling: set neuron_config.on_device_sampling_config "
            "in --additional-config, or pass --no-async-scheduling.",
        )
    scales = None
    if "GptOssForCausalLM" in (config.get("architectures") or []):
        scales = load_gpt_oss(Path(args.model), config, neuron_config, platform_target(), kv_dtype)
    else:
        for shape in read_kv_scale_shapes(Path(args.model)).values():
            if shape == []:
                fail("IndexError", "slice() cannot be applied to a 0-dim tensor.")
    segmented = args.enable_prefix_caching is not False or (
        (args.max_num_batched_tokens or 8192)
        < (args.max_model_len or config.get("max_position_embeddings", 0))
    )
    if kv_dtype in ("fp8", "fp8_e4m3") and segmented:
        time.sleep(0.2)  # found while compiling the segmented-prefill graph
        fail(
            "NotImplementedError",
            "FP8 segmented prefill requires a packed KV cache; attention_segmented_cte cannot "
            "read a non-packed FP8 K cache. Non-packed FP8 is supported for full prefill only.",
        )
    return scales


def load_gpt_oss(
    model: Path, config: dict, neuron_config: dict, target: str, kv_dtype: str
) -> dict[str, float] | None:
    """vllm_neuron/model/gpt_oss/: the factory's choice, then its load_weights (the fake plugin's gpt_oss.py)."""
    from vllm_neuron import gpt_oss
    from vllm_neuron.checkpoint import SafetensorsCheckpoint

    try:
        implementation = gpt_oss.select_implementation(neuron_config, target)
        log(f"GptOssForCausalLM on {target}: {implementation}")
        checkpoint = SafetensorsCheckpoint(model)
        gpt_oss.load_weights(implementation, checkpoint, config, log)
        return gpt_oss.load_kv_cache_scales(checkpoint, config["num_hidden_layers"], kv_dtype, log)
    except (ValueError, KeyError, IndexError, RuntimeError) as exc:
        fail(type(exc).__name__, repr(exc.args[0]) if isinstance(exc, KeyError) else str(exc))


def check_cpu(config: dict, kv_dtype: str) -> None:
    if not kv_dtype.startswith("fp8"):
        return
    flags = os.environ.get("FAKE_VLLM_CPU_FLAGS", "avx512f").split()
    if "avx512f" not in flags and "amx_tile" not in flags:
        fail("NotImplementedError", "FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head % 32:
        fail("NotImplementedError", "FP8 KV cache requires head_size divisible by 32 on CPU.")


def token_id(piece: str) -> int:
    return 10 + zlib.crc32(piece.encode()) % 49000


def tokenize(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


def kv_scale_values(model: Path) -> dict[str, float]:
    """Every float32 *k_scale / *v_scale of shape [1] in the checkpoint, read from its safetensors files."""
    values = {}
    for f, start, key, entry in kv_scale_entries(model):
        if entry.get("dtype") == "F32" and entry.get("shape") == [1]:
            f.seek(start + entry["data_offsets"][0])
            (values[key],) = struct.unpack("<f", f.read(4))
    return values


def saturation(model: Path, fp8_max: float, scales: dict[str, float] | None = None) -> float:
    """The mean fraction of each layer's K/V range above scale x fp8_max (0 without kvcalib provenance).
    `scales`: what the model loaded (None: every *k_scale / *v_scale in the files)."""
    if MODE == "ignore-scales":
        return 0.0
    try:
        layers = json.loads((model / "kvcalib_calibration.json").read_text())["layers"]
    except (OSError, ValueError, KeyError):
        return 0.0
    scales = kv_scale_values(model) if scales is None else scales
    fractions = []
    for entry in layers:
        for kind in ("k", "v"):
            scale, absmax = (
                scales.get(f"model.layers.{entry['layer']}.self_attn.{kind}_scale"),
                entry[kind]["absmax"],
            )
            if scale and absmax > 0:
                if MODE == "inverted-scales":
                    scale = (
                        absmax / fp8_max
                    ) ** 2 / scale  # the mirror image around the right scale
                fractions.append(max(0.0, 1.0 - scale * fp8_max / absmax))
    return sum(fractions) / len(fractions) if fractions else 0.0


class Engine:
    def __init__(
        self,
        model: str,
        names: list[str],
        fp8: bool,
        fp8_max: float = 448.0,
        max_model_len: int | None = None,
        scales: dict[str, float] | None = None,
    ) -> None:
        self.model, self.names, self.fp8, self.max_model_len = model, names, fp8, max_model_len
        self.requests = 0
        self.saturated = saturation(Path(model), fp8_max, scales) if fp8 else 0.0
        self.broken = MODE == "diverge" or self.saturated > 0.5

    def logprob(self, tid: int) -> float:
        lp = -(1.0 + (tid % 7) / 10)
        if self.fp8:
            lp -= 3.0 if MODE == "diverge" else 0.05 + 3.0 * self.saturated
        return lp

    def complete(self, body: dict) -> dict:
        """A batch of prompts (a list of strings or of token-id lists, as lm-eval sends them) gets one choice each."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            answers = [self.complete({**body, "prompt": one}) for one in prompt]
            refused = [a for a in answers if "status" in a]
            if refused:
                return refused[0]
            choices = [dict(a["choices"][0], index=i) for i, a in enumerate(answers)]
            return dict(answers[-1], choices=choices)
        return self.complete_one(body)

    def complete_one(self, body: dict) -> dict:
        self.requests += 1
        if MODE == "die-mid-probe" and self.fp8 and self.requests >= 2:
            print(
                "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
                "(above) for the root cause.",
                flush=True,
            )
            os._exit(1)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt_ids, text_prompt = [int(t) for t in prompt], None
        else:
            text_prompt = str(prompt)
            prompt_ids = [token_id(p) for p in tokenize(text_prompt)]
        max_tokens = int(body.get("max_tokens") or 16)
        if self.max_model_len and len(prompt_ids) + max_tokens > self.max_model_len:
            return {
                "status": 400,
                "error": {
                    "message": f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, "
                    f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            }
        if (MODE == "degenerate" and self.fp8) or MODE == "repetitive":
            pieces = ["!"] * max_tokens
        else:
            source = CONTINUATIONS.get(text_prompt or "", GENERIC)
            passkey = re.search(r"The pass key is (\d+)\.", text_prompt or "")
            if passkey and (text_prompt or "").rstrip().endswith("The pass key is"):
                lost = self.fp8 and MODE == "forget-long" and len(prompt_ids) > LONG_PROMPT
                source = f" {'not given' if lost else passkey.group(1)}. The grass is green."
            if self.broken:
                source = " purple " + source
            words = tokenize(source)
            pieces = [words[i % len(words)] for i in range(max_tokens)]
        choice = {
            "index": 0,
            "text": "".join(pieces),
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = [token_id(p) for p in pieces]
            choice["prompt_token_ids"] = prompt_ids
        top = body.get("prompt_logprobs")
        if top is not None:
            entries = [None]
            for tid in prompt_ids[1:]:
                rank = 2 if self.broken else 1
                entry = {
                    str(tid): {"logprob": self.logprob(tid), "rank": rank, "decoded_token": "?"}
                }
                if top >= 1 and rank != 1:
                    entry[str(tid + 1)] = {"logprob": -0.5, "rank": 1, "decoded_token": "?"}
                entries.append(entry)
            choice["prompt_logprobs"] = entries
        if (
            body.get("echo") and body.get("logprobs") is not None
        ):  # OpenAI's form: the prompt's tokens, then the new
            ids = prompt_ids + [token_id(p) for p in pieces]
            lps = [None] + [self.logprob(t) for t in ids[1:]]
            choice["text"] = (text_prompt or "") + choice["text"]
            choice["logprobs"] = {
                "tokens": [str(t) for t in ids],
                "token_logprobs": lps,
                "top_logprobs": [None]
                + [{str(t + 1 if self.broken else t): -0.5} for t in ids[1:]],
                "text_offset": list(range(len(ids))),
            }
        return {
            "id": f"cmpl-{self.requests}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": max_tokens},
        }


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args) -> None:
            log(
                f'{self.address_string()} - "{self.requestline}" {args[1] if len(args) > 1 else ""}'
            )

        def _send(self, code: int, obj: object | None) -> None:
            data = b"" if obj is None else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, None)
            elif self.path == "/v1/models":
                self._send(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": n, "object": "model"} for n in engine.names],
                    },
                )
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = json.loads(
                self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}"
            )
            if self.path != "/v1/completions":
                self._send(404, {"detail": "Not Found"})
            elif body.get("model") not in engine.names:
                self._send(
                    404,
                    {
                        "error": {
                            "message": f"The model `{body.get('model')}` does not exist.",
                            "type": "NotFoundError",
                            "param": "model",
                            "code": 404,
                        }
                    },
                )
            else:
                answer = engine.complete(body)
                self._send(answer.pop("status", 200), answer)

    return Handler


def start_engine_core(model: str) -> subprocess.Popen:
    ignore = (
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        if os.environ.get("FAKE_VLLM_IGNORE_SIGTERM")
        else ""
    )
    code = f"import signal, time; {ignore}time.sleep(3600)"
    # Same process group, like vLLM's EngineCore; the model path in argv lets tests find it.
    return subprocess.Popen([sys.executable, "-c", code, "fake-engine-core", model])


def main() -> None:
    args = parse_args(sys.argv[1:])
    neuron = importlib.util.find_spec("vllm_neuron") is not None
    log(f"non-default args: {vars(args)}")
    model = Path(args.model)
    try:
        config = json.loads((model / "config.json").read_text())
    except OSError:
        fail(
            "OSError",
            f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{args.model}'. "
            "Use `repo_type` argument if needed.",
        )
    kv_dtype = resolve_kv_dtype(args, config, neuron)
    fp8 = kv_dtype.startswith("fp8")
    platform = "neuron" if neuron else os.environ.get("FAKE_VLLM_PLATFORM", "cpu")
    log(f"platform: {platform}, kv cache dtype {kv_dtype}")
    scales = None
    if neuron:
        scales = check_neuron(args, config, kv_dtype)
    elif platform == "cpu":
        check_cpu(config, kv_dtype)
    child = start_engine_core(args.model)

    def shutdown(signum, frame) -> None:
        log("Shutting down FastAPI HTTP server.")
        child.terminate()
        child.wait()
        sys.exit(0)

    def ignore(signum, frame) -> None:
        log("SIGTERM received and ignored")

    signal.signal(
        signal.SIGTERM, ignore if os.environ.get("FAKE_VLLM_IGNORE_SIGTERM") else shutdown
    )
    if fp8 and MODE == "crash":
        time.sleep(0.3)
        fail("IndexError", "slice() cannot be applied to a 0-dim tensor.")
    if fp8 and MODE == "crash-unknown":
        time.sleep(0.3)
        fail("RuntimeError", "something nobody has seen before")
    if fp8 and MODE == "oom":
        fail(
            "ValueError",
            "Available memory on node 0 (1.02/12.21 GiB) on startup is less than desired CPU memory "
            "utilization (0.92, 11.24 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the "
            "fraction of CPU memory reserved (despite its name).",
        )
    delay = float(os.environ.get("FAKE_VLLM_HEALTH_DELAY", "1.0"))
    log("Loading model weights ...")
    time.sleep(delay)
    while fp8 and MODE == "hang":
        log("still compiling ...")
        time.sleep(1.0)
    names = args.served_model_name or [args.model]
    server = ThreadingHTTPServer(
        (args.host or "0.0.0.0", args.port),
        make_handler(
            Engine(args.model, names, fp8, 240.0 if neuron else 448.0, args.max_model_len, scales)
        ),
    )
    log(f"Starting vLLM API server 0 on http://{args.host}:{args.port}")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main()
