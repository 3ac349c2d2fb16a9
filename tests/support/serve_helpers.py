"""For serve-check's tests: the fake vLLM interpreter, a small calibrated Llama, leftover checks."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

FAKES = Path(__file__).resolve().parent / "fakes"
FAKE_BIN = FAKES / "bin"  # the fake neuron-ls


def fake_python(directory: Path, neuron: bool = False, cuda: bool = False) -> Path:
    """An executable `python` that runs this interpreter with the fake vllm (and Neuron plugin, or a CUDA torch)
    importable."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = (
        [str(FAKES)]
        + ([str(FAKES / "neuron")] if neuron else [])
        + ([str(FAKES / "cuda")] if cuda else [])
    )
    script = directory / "python"
    script.write_text(
        f'#!/bin/sh\nPYTHONPATH="{os.pathsep.join(paths)}" exec "{sys.executable}" "$@"\n'
    )
    script.chmod(0o755)
    return script


def build_llama_head32(out_dir: Path) -> Path:
    """A 2-layer Llama with head_dim 32 (vLLM's CPU FP8 KV cache needs a multiple of 32), bf16."""
    import torch
    from helpers import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def processes_mentioning(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line or environment contains `marker`.

    The environment also catches children that keep it, such as multiprocessing's resource
    tracker. vLLM's engine core and workers rename themselves (VLLM::EngineCore), which overwrites
    both: `session_members` finds those, by the sessions serve-check's servers lead.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (marker in cmdline or marker in environ) and state not in ("Z", "X"):
            found.append((int(entry.name), cmdline))
    return found


def session_members(leaders: Iterable[int]) -> set[tuple[int, str]]:
    """Live processes in the sessions or process groups that `leaders` lead: everything a server that
    serve-check started (start_new_session: pid == session == group) left behind, vLLM's renamed
    VLLM::EngineCore and workers included. Processes of anyone else on the host never count."""
    wanted = {str(pid) for pid in leaders}
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (
                (entry / "stat").read_text().rsplit(")", 1)[1].split()
            )  # state ppid pgrp session ...
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and (fields[2] in wanted or fields[3] in wanted):
            found.add((int(entry.name), cmdline))
    return found


def assert_sessions_gone(leaders: Iterable[int], timeout_s: float = 10.0) -> None:
    """Nothing is left of the servers whose pids serve-check reported (waits for the kernel to reap)."""
    leaders = list(leaders)
    deadline = time.monotonic() + timeout_s
    while session_members(leaders) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_members(leaders) == set(), f"left behind by the servers {leaders}"


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def ports_in(text: str) -> list[int]:
    """The --port values of the commands serve-check printed."""
    return [int(p) for p in re.findall(r"--port (\d+)", text)]


def assert_nothing_left(marker: str, output: str) -> None:
    """No process mentions the checkpoint any more, and no port serve-check used still listens."""
    deadline = time.monotonic() + 5.0
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(marker) == []
    for port in ports_in(output):
        assert not listening(port), f"port {port} still listening"


# The fake host's CPU, as serve-check's pre-flight reads it: AVX-512, whatever CPU runs the tests.
FAKE_HOST_CPU_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512bw"


def serve(
    ckpt: Path, python: Path, *extra: str, env: dict[str, str] | None = None, monkeypatch=None
):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    args = [
        "serve-check",
        str(ckpt),
        "--vllm-python",
        str(python),
        "--log-dir",
        str(ckpt.parent / "logs"),
        "--stop-timeout",
        "5",
        *extra,
    ]
    from typer.testing import CliRunner

    from kvcalib.cli import app

    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.stderr.split("--- last lines of")[0], result.stderr
    return result
