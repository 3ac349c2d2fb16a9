"""eval-tasks and the lm-eval model "kvcalib": lm-eval's own tasks, prompts and metrics on local YAML tasks."""

from __future__ import annotations

import json
import socket
import sys

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager
from typer.testing import CliRunner

import kvcalib.evaluation.harness as harness
from kvcalib.cli import app
from kvcalib.core import fp8
from kvcalib.core.errors import UsageError
from kvcalib.core.options import ModelOptions
from kvcalib.evaluation.emulate import KVQuantizer
from kvcalib.evaluation.tasks import TaskOptions, evaluate_tasks
from kvcalib.hf.attention import ObservedCache
from kvcalib.hf.internals import cache_kwargs

TASKS = ["kvcalib_tiny_mc", "kvcalib_tiny_gen"]


def responses(out: dict, task: str) -> dict:
    return {item["doc_id"]: item["filtered_resps"] for item in out["samples"][task]}


def run(model: str, args: str, task_dir) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=TASKS,
        log_samples=True,
        device="cpu",
        task_manager=TaskManager(include_path=str(task_dir)),
    )


@pytest.fixture(scope="module")
def hf_run(tiny_llama_master, task_dir):
    """lm-eval's own HF model on the uncalibrated weights (a calibrated checkpoint's quantization_config would make
    transformers load it through compressed-tensors, which quantises the KV cache itself)."""
    return run("hf", f"pretrained={tiny_llama_master},dtype=float32", task_dir)


def test_the_registered_model_with_no_scales_is_lm_evals_hf_model(hf_run, calibrated, task_dir):
    ours = run("kvcalib", f"pretrained={calibrated},scales=none", task_dir)
    quantised = run("kvcalib", f"pretrained={calibrated},scales=checkpoint,target=trn2", task_dir)
    for task in TASKS:
        assert responses(ours, task) == responses(hf_run, task)  # identical, item by item
    base, fp8_kv = responses(ours, TASKS[0]), responses(quantised, TASKS[0])
    assert base != fp8_kv  # the K/V really are quantised ...
    for doc, answers in base.items():  # ... and by FP8's small amount
        assert [a[0] for a in fp8_kv[doc]] == pytest.approx([a[0] for a in answers], abs=0.5)


def test_eval_tasks_end_to_end(hf_run, calibrated, task_dir):
    result = CliRunner().invoke(
        app,
        [
            "eval-tasks",
            str(calibrated),
            "--tasks",
            ",".join([*TASKS, "kvcalib_tiny_ppl"]),
            "--include-path",
            str(task_dir),
            "--compare",
            "unit",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["runs"] == ["baseline", "checkpoint", "unit"] and payload["lm_eval"] == "0.4.13"
    rows = {row["task"]: row for row in payload["rows"]}
    mc = rows["kvcalib_tiny_mc"]
    assert mc["metric"] == "acc" and mc["items"] == 6
    assert (
        mc["baseline"] == hf_run["results"]["kvcalib_tiny_mc"]["acc,none"]
    )  # the baseline is lm-eval's own
    for name in ("checkpoint", "unit"):
        interval = mc["intervals"][name]
        assert (
            interval["items"] == 6 and interval["low"] <= interval["estimate"] <= interval["high"]
        )
        assert interval["estimate"] == pytest.approx(mc["scores"][name] - mc["baseline"])
    assert (
        rows["kvcalib_tiny_gen"]["baseline"]
        == hf_run["results"]["kvcalib_tiny_gen"]["exact_match,none"]
    )
    ppl = rows[
        "kvcalib_tiny_ppl"
    ]  # aggregated by weighted perplexity: no per-item paired form, no interval
    assert ppl["intervals"] == {"checkpoint": None, "unit": None}
    assert "weighted_perplexity" in ppl["no_interval_reason"]
    assert (
        ppl["baseline"] > 1 and ppl["scores"]["unit"] > 1
    )  # lm-eval's own aggregate, reported as it is
    assert (
        "lm-eval tasks with FP8 KV on trn2" in result.stderr and "paired bootstrap" in result.stderr
    )


def test_generation_decodes_from_the_quantised_cache(calibrated):
    """Prefill then one decoded token reads the same FP8 K/V as one prefill of the whole sequence; generation
    writes every new token's K/V through the quantiser."""
    loaded = harness.load(calibrated, ModelOptions(dtype="float32"))
    model = harness.KvcalibLM(loaded, scales="checkpoint")
    quantizer = model.quantizer
    ids = torch.tensor([[5, 17, 23, 42, 8, 9, 11]])
    with torch.inference_mode():
        whole = loaded.model(
            ids, **cache_kwargs(loaded.model, ObservedCache(loaded.model.config, quantizer.observe))
        ).logits[0, -1]
        cache = ObservedCache(loaded.model.config, quantizer.observe)
        loaded.model(ids[:, :-1], **cache_kwargs(loaded.model, cache))
        stepped = loaded.model(ids[:, -1:], **cache_kwargs(loaded.model, cache)).logits[0, -1]
    torch.testing.assert_close(stepped, whole, atol=1e-4, rtol=1e-4)

    calls = []

    class Counting(KVQuantizer):
        def observe(self, layer_idx, key, value):
            calls.append(key.shape[2])
            return super().observe(layer_idx, key, value)

    model.quantizer = Counting(quantizer.k_scales, quantizer.v_scales, fp8.get_target("trn2"))
    out = model._model_generate(ids, max_length=ids.shape[1] + 4, stop=[], do_sample=False)
    layers = loaded.model.config.num_hidden_layers
    assert out.shape[1] == ids.shape[1] + 4
    assert calls == [ids.shape[1]] * layers + [1] * (
        3 * layers
    )  # the prompt, then each decoded token's K/V


def test_scoring_the_continuations_logits_only_changes_no_answer(calibrated, task_dir):
    """Under FP8 KV, logits are made for the last positions of each batch only (the longest continuation plus the
    padding): every log-likelihood and greedy flag is the one full logits give, in right-padded batches too."""
    loaded = harness.load(calibrated, ModelOptions(dtype="float32"))
    kept, full = (harness.KvcalibLM(loaded, scales="checkpoint", batch_size=3) for _ in range(2))
    full._logits_to_keep = lambda inps: 0
    widths = []
    keep = kept._logits_to_keep
    kept._logits_to_keep = lambda inps: widths.append((keep(inps), inps.shape[1])) or widths[-1][0]
    manager = TaskManager(include_path=str(task_dir))
    outs = [
        lm_eval.simple_evaluate(model=m, tasks=TASKS[:1], log_samples=True, task_manager=manager)
        for m in (kept, full)
    ]
    assert responses(outs[0], TASKS[0]) == responses(outs[1], TASKS[0])
    assert any(
        0 < kept_ < width for kept_, width in widths
    )  # it really scored fewer positions (0: all of them)


def test_bad_task_input_is_refused_before_the_model_loads(calibrated, task_dir, monkeypatch):
    base = ["eval-tasks", str(calibrated), "--include-path", str(task_dir)]
    cases = [
        (
            [*base, "--tasks", "kvcalib_tiny_mcc"],
            "unknown task 'kvcalib_tiny_mcc'; close names: kvcalib_tiny_mc",
        ),
        ([*base, "--tasks", "kvcalib_tiny_mc", "--limit", "0"], "--limit"),
        ([*base, "--tasks", "kvcalib_tiny_mc", "--limit", "-1"], "--limit"),
        ([*base, "--tasks", "kvcalib_tiny_mc", "--num-fewshot", "-1"], "--num-fewshot"),
        (
            [
                *base,
                "--tasks",
                "kvcalib_tiny_mc",
                "--num-fewshot",
                "6",
            ],  # 6 items: 5 others to draw from
            "--num-fewshot 6: task kvcalib_tiny_mc has 5 example(s) to draw from",
        ),
        (["eval", str(calibrated), "--tasks", "x"], "now its own command: kvcalib eval-tasks"),
    ]
    for argv, message in cases:
        result = CliRunner().invoke(app, argv)
        assert (
            result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
        ), argv
    missing = CliRunner().invoke(
        app, [*base, "--tasks", "kvcalib_tiny_mc", "--task-data", str(task_dir / "none")]
    )
    assert (
        missing.exit_code == 2
        and "no tasks/ folder" in missing.stderr
        and "prepare_tasks.py" in missing.stderr
    )

    # a hub task with no way to the hub: refused at once, naming the task and the offline way
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(
        socket, "create_connection", no_network
    )  # the machine's network, not kvcalib's code
    offline = CliRunner().invoke(
        app, ["eval-tasks", str(calibrated), "--tasks", "arc_easy", "--limit", "2"]
    )
    assert offline.exit_code == 2, offline.stderr
    assert "task arc_easy reads allenai/ai2_arc from the Hugging Face hub" in offline.stderr
    assert "--task-data" in offline.stderr

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    with pytest.raises(UsageError, match="lm-eval-harness, which is not installed") as exc:
        evaluate_tasks(str(calibrated), TaskOptions(tasks=("kvcalib_tiny_mc",)))
    assert "kvcalib[tasks]" in exc.value.hint
