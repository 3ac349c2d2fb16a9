"""calibrate --plan: the checks, the engine, memory and disk, and a wall-time estimate from a short timed probe,
with nothing written. The tests hold the plan to what it can foresee (engine, parts); how close
its seconds come to the run's is measured beside, by hand, in scripts/BENCHMARKS.md: a time compared in a shared
test process is noise, not a check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvcalib.cli import app

runner = CliRunner()


def plan(*args) -> tuple[int, dict, str]:
    result = runner.invoke(app, ["calibrate", *map(str, args), "--plan", "--json"])
    assert "Traceback" not in result.stderr, result.stderr
    return result.exit_code, json.loads(result.stdout) if result.stdout else {}, result.stderr


def listing(path) -> list[str]:
    return sorted(os.listdir(path))


@pytest.mark.slow
def test_the_plan_estimates_the_smollm2_run(smollm2, text_dataset, tmp_path):
    """SmolLM2-135M, 16 x 64: the plan probes, writes nothing, and estimates each phase; the run it plans then
    succeeds. The estimate against the run is printed, not asserted: wall time on a shared host is no test
    (scripts/BENCHMARKS.md, "Time estimate of calibrate --plan", has SmolLM2 run alone)."""
    out, args = (
        tmp_path / "out",
        ["--num-samples", "16", "--max-seq-len", "64", "--bf16-compute", "float32"],
    )
    code, planned, stderr = plan(smollm2, "--dataset", text_dataset, "-o", out, *args)
    assert code == 0 and planned["refusals"] == [] and listing(tmp_path) == [], stderr
    assert (
        planned["engine"] == "native" and planned["weights_linked"] and planned["num_layers"] == 30
    )
    # the probe: the rows the objective samples (all 16 here), 4 batches, through 2 layers of the stream engine
    probe = planned["probe"]
    assert probe["batches"] == 4 and probe["layers"] == 2
    assert probe["tokens"] == planned["num_tokens"] > 0 and probe["sample_bytes"] > 0
    # the peak holds this process, every layer's samples, the weights and a batch's activations
    held = probe["base_rss_bytes"] + probe["sample_bytes"] * 30
    assert planned["peak_memory_bytes"] > held + planned["weight_bytes"] > held + (200 << 20)
    assert "plan: nothing written" in stderr and "estimate" in stderr
    run = runner.invoke(
        app,
        [
            "calibrate",
            str(smollm2),
            "--dataset",
            str(text_dataset),
            "-o",
            str(out),
            *args,
            "--json",
        ],
    )
    assert run.exit_code == 0, run.stderr
    seconds, estimate = json.loads(run.stdout)["seconds"], planned["estimate_seconds"]["total"]
    print(f"SmolLM2 16 x 64: estimated {estimate:.1f} s, ran {seconds:.1f} s")
    assert (
        estimate > 0 and seconds > 0 and all(v >= 0 for v in planned["estimate_seconds"].values())
    )


def test_the_stream_engine_is_probed_on_its_first_layers(tiny_llama_master, text_dataset, tmp_path):
    flags = (
        "--num-samples 8 --max-seq-len 32 --engine stream --max-memory 1 --dtype bfloat16".split()
    )
    args = (tiny_llama_master, "--dataset", text_dataset, "-o", tmp_path / "out", *flags)
    code, planned, stderr = plan(*args, "--bf16-compute", "float32")
    assert code == 0 and planned["engine"] == "stream", stderr
    # the plan sizes by the memory check_run resolved: --max-memory's cap, not only the host's
    assert planned["memory_limit_bytes"] == 1 << 30 and planned["memory_source"] == "--max-memory 1"
    probe, estimate = planned["probe"], planned["estimate_seconds"]
    assert probe["layers"] == 2 and probe["batches"] == 2 and planned["num_layers"] == 3
    assert estimate["total"] > 0 and estimate["observe"] > 0 and listing(tmp_path) == []
    # bf16 computed in float32 holds up_proj's output in float32 besides bf16 (2 bytes more an intermediate unit)
    # and the attention's float32 K, V and scores (32 a hidden unit), a token of the largest batch (4 rows of <= 32)
    config = json.loads((tiny_llama_master / "config.json").read_text())
    per_token = 2 * config["intermediate_size"] + 32 * config["hidden_size"]
    native = plan(*args, "--bf16-compute", "native")[1]
    assert native["compute"].startswith("native"), native
    held = [
        p["probe"]["base_rss_bytes"] + 3 * p["probe"]["sample_bytes"] for p in (planned, native)
    ]
    more = planned["peak_memory_bytes"] - held[0] - (native["peak_memory_bytes"] - held[1])
    assert more % (4 * per_token) == 0 and 0 < more <= 4 * 32 * per_token
    kv = planned["kv_cache"]  # what FP8 buys: half the bytes per token and per max-length sequence
    assert kv["per_token"]["fp8"] * 2 == kv["per_token"]["bf16"] > 0 and kv["windowed"] is None
    assert (
        kv["sequence"]["bf16"] == kv["per_token"]["bf16"] * kv["context"]
        and "B/token bf16" in stderr
    )


def test_what_would_stop_the_run_is_a_refusal_and_nothing_is_touched(
    tiny_llama_master, text_dataset, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    leftover = (
        tmp_path / ".out.kvcalib-interrupted"
    )  # an interrupted run's staging directory: only a run recovers it
    leftover.mkdir()
    before = listing(tmp_path)
    args = (tiny_llama_master, "--dataset", text_dataset, "-o", out, "--num-samples", "4")
    code, planned, stderr = plan(*args, "--max-seq-len", "32")
    assert code == 0 and len(planned["refusals"]) == 1 and "exists" in planned["refusals"][0], (
        stderr
    )
    assert (
        "calibrate would stop" in stderr
        and listing(tmp_path) == before
        and listing(out) == ["mine.txt"]
    )
    # wrong arguments are usage errors, as for a run (exit 2, before anything is read)
    code, _, stderr = plan(*args[:5], "--num-samples", "0")
    assert code == 2 and "--num-samples" in stderr


def test_the_plan_estimates_the_tiny_mxfp4_gpt_oss_run(text_dataset, tmp_path):
    """GPT-OSS as released (MXFP4 experts, dequantised as they load), streamed as a 120B would be, each command in
    its own process as a user runs them: the plan refuses nothing for trn2, writes nothing, and estimates the run,
    which then succeeds. The estimate against the run is printed, not asserted (measured: 3.3 s against 4.0 s;
    scripts/BENCHMARKS.md has more)."""
    from mxfp4 import build_gpt_oss_mxfp4

    model = build_gpt_oss_mxfp4(tmp_path / "released")
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "kvcalib",
        "calibrate",
        str(model),
        "--dataset",
        str(text_dataset),
        "-o",
        str(out),
        *"--num-samples 16 --max-seq-len 64 --target trn2 --engine stream --json".split(),
    ]
    planned = subprocess.run([*command, "--plan"], capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0 and "Traceback" not in planned.stderr, planned.stderr
    plan_json = json.loads(planned.stdout)
    assert (
        plan_json["refusals"] == []
        and plan_json["engine"] == "stream"
        and plan_json["weights_linked"]
    )
    kv = plan_json[
        "kv_cache"
    ]  # GPT-OSS alternates sliding (window 8 here) and full attention layers
    assert (
        kv["window"] == 8
        and kv["sliding_layers"] > 0
        and kv["windowed"]["fp8"] < kv["sequence"]["fp8"]
    )
    assert listing(tmp_path) == ["released"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    estimate, seconds = plan_json["estimate_seconds"]["total"], json.loads(run.stdout)["seconds"]
    print(f"tiny GPT-OSS (MXFP4), streamed: estimated {estimate:.1f} s, ran {seconds:.1f} s")
    assert estimate > 0 and seconds > 0
