"""The whole-model step (kvcalib.calibration.output): its decision rule by construction, and on the planted tiny
Llama (near-constant K channels in layer 0) in every engine: in memory, streamed, per head, under torchrun; out of
memory (the objective's picks stand) and a rank failing in it (every rank ends at once)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from planted import build_planted_llama, every_kind_weighed
from rich.console import Console

from kvcalib.calibration import objective, output
from kvcalib.calibration.engine import Observation
from kvcalib.calibration.options import CalibrateOptions, Machine
from kvcalib.calibration.output import decide, held_out_rows
from kvcalib.calibration.pipeline import calibrate
from kvcalib.calibration.scales import layer_scales
from kvcalib.cli.render import render_calibration
from kvcalib.core import fp8
from kvcalib.core.choice import ScaleChoice
from kvcalib.core.records import to_json
from kvcalib.core.schema import PROVENANCE_FILENAME

# 64 rows of 64 tokens: the objective samples 32 (2,048 tokens), the step scores 16 of the rest (1,024 tokens)
STEP = dict(num_samples=64, max_seq_len=64, batch_size=4)


@pytest.fixture(scope="module")
def planted(tmp_path_factory, text_dataset):
    return build_planted_llama(tmp_path_factory.mktemp("planted") / "planted", text_dataset)


def _grid():
    return objective.candidates(torch.tensor([240.0]), fp8.get_target("trn2"), per_head=False)


def test_a_clear_winner_wins_and_a_tie_goes_to_the_least_clipping():
    grid = _grid()
    absmax, half, quarter = (
        (0,),
        (grid.labels.index("absmax x0.5"),),
        (grid.labels.index("absmax x0.25"),),
    )
    tokens = [100.0] * 8
    noisy = [1.0 + 0.01 * (-1) ** r for r in range(8)]
    # x0.25 costs a tenth of the others on every row: it wins although it clips the most
    costs = {half: noisy, absmax: noisy, quarter: [0.1] * 8}
    assert decide(costs, tokens, grid, half) == quarter
    # x0.5 is lower on average but not on every row beyond the noise: a tie, the least clipping (absmax) wins
    costs = {half: [0.995 + 0.05 * (-1) ** r for r in range(8)], absmax: [1.0] * 8}
    assert sum(costs[half]) < sum(costs[absmax])
    assert decide(costs, tokens, grid, half) == absmax
    # exactly equal: absmax again (it clips nothing); among equal clips the objective's own
    assert decide({half: noisy, absmax: noisy}, tokens, grid, half) == absmax


def test_a_non_finite_cost_neither_wins_nor_ties():
    grid = _grid()
    absmax, half = (0,), (grid.labels.index("absmax x0.5"),)
    tokens, nan, inf = [100.0] * 8, float("nan"), float("inf")
    # the objective's absmax is NaN on a row and lower elsewhere: x0.5, finite, wins (a tie would go to absmax)
    assert decide({absmax: [nan] + [0.1] * 7, half: [1.0] * 8}, tokens, grid, absmax) == half
    # absmax is infinite on a row: the objective's x0.5 stands
    assert decide({half: [1.0] * 8, absmax: [inf] + [0.1] * 7}, tokens, grid, half) == half
    # nothing finite: the objective's own
    assert decide({half: [nan] * 8, absmax: [inf] * 8}, tokens, grid, half) == half


@pytest.mark.parametrize("per_head", [False, True])
def test_the_step_scores_the_scales_written_and_headroom_keeps_a_clip(per_head):
    """K absmax [10, 6] per KV head, a clip to 7.07 (absmax x0.7071; per head: head 0's) and --headroom 1.4142:
    the step's quantizer has the scales layer_scales writes. Per tensor the clip stays (head 1's absmax, kept,
    does not widen it); per head, head 1 (absmax) gets its headroom."""
    trn2, heads, headroom = fp8.get_target("trn2"), torch.tensor([10.0, 6.0]), 1.4142
    cands = objective.candidates(heads, trn2, per_head)
    clip = cands.labels.index("absmax x0.7071")
    index = (clip, 0) if per_head else (clip,)
    pick = objective.Pick(cands, index, ScaleChoice("per head" if per_head else "absmax x0.7071"))
    observation = Observation((heads,), (heads,), (1,), {0: "model.layers.0.self_attn"}, 0.0)
    strategy = "attn_head" if per_head else "tensor"
    [written], _ = layer_scales(
        observation, trn2, Path("model"), strategy, choices=[[pick, pick]], headroom=headroom
    )
    scored = output._quantizer([(pick, pick)], [[index, index]], trn2, headroom).k_scales[0]
    clipped = float(cands.scales[clip, 0])
    if per_head:
        widened = float(fp8.scale_from_absmax(heads * headroom, trn2)[1])
        assert written.k.head_scales == (clipped, widened)
        assert scored.flatten().tolist() == list(written.k.head_scales)
    else:
        assert scored == written.k.scale == clipped


def test_held_out_rows_are_never_the_objectives():
    sequences = [tuple(range(n, n + 40)) for n in range(20)]
    chose = frozenset(sequences[:12])
    rows = held_out_rows(sequences, chose, tokens=64, row_tokens=16)
    assert rows == [s[:16] for s in sequences[12:16]]


def test_the_step_weighs_a_close_call_and_records_it(planted, text_dataset, tmp_path):
    result = calibrate(planted, str(text_dataset), tmp_path / "out", CalibrateOptions(**STEP))
    step = result.output_step
    assert step.skipped is None and step.rows == 16 and step.tokens > 0 and step.weighed >= 1
    assert 2 + 2 * step.weighed <= step.forwards <= step.budget
    k = result.layers[0].k
    assert (
        k.choice.step == "output"
        and "absmax" in dict(k.choice.output)
        and len(k.choice.output) >= 2
    )
    grid = objective.candidates(torch.tensor([k.absmax]), fp8.get_target("trn2"), per_head=False)
    assert k.scale == float(
        grid.scales[grid.labels.index(k.choice.label), 0]
    )  # the written scale is the pick's
    provenance = json.loads((tmp_path / "out" / PROVENANCE_FILENAME).read_text())
    assert provenance["scale_objective"] == "output"
    assert provenance["layers"][0]["k"]["choice"] == to_json(k.choice)
    assert to_json(result)["output_step"]["weighed"] == step.weighed
    console = Console(file=io.StringIO(), width=300)
    render_calibration(console, result, [])
    assert "(in-sample: on the rows that chose)" in console.file.getvalue()


def test_where_no_candidate_has_a_finite_kl_the_objectives_pick_stands(
    planted, text_dataset, tmp_path, monkeypatch
):
    nan = float("nan")
    monkeypatch.setattr(output, "row_sums", lambda values, scored: torch.full((len(values),), nan))
    result = calibrate(planted, str(text_dataset), tmp_path / "out", CalibrateOptions(**STEP))
    step = result.output_step
    assert step.weighed >= 1 and step.changed == 0 and len(step.non_finite) == step.weighed
    assert any(
        f"not finite for every candidate of {step.non_finite[0]}" in w for w in result.warnings
    )


def test_with_attention_scales_the_step_weighs_fp8_attention(
    planted, text_dataset, tmp_path, monkeypatch
):
    """--attention-scales: every quantizer the step scores with carries the Q scales written, as FP8 attention."""
    built = []
    quantizer = output._quantizer
    monkeypatch.setattr(output, "_quantizer", lambda *a: built.append(quantizer(*a)) or built[-1])
    options = CalibrateOptions(attention_scales=True, **STEP)
    result = calibrate(planted, str(text_dataset), tmp_path / "out", options)
    assert result.output_step.weighed >= 1 and built
    written = [layer.q.scale for layer in result.layers]
    assert all(q.fp8_attention and q.q_scales == written for q in built)


def test_per_head_scales_are_weighed_per_head(planted, text_dataset, tmp_path):
    result = calibrate(
        planted,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(target="gpu", strategy="attn_head", **STEP),
    )
    [k] = [s for layer in result.layers for s in (layer.k, layer.v) if s.choice.output]
    assert result.output_step.weighed == 1 and k.choice.step == "output" and len(k.head_scales) == 2
    grid = objective.candidates(torch.tensor(k.head_absmax), fp8.get_target("gpu"), per_head=True)
    assert len(k.choice.output) >= 2 and all(isinstance(kl, float) for _, kl in k.choice.output)
    if (
        k.choice.label != "per head"
    ):  # one candidate on every head: each head's scale is that candidate's
        c = grid.labels.index(k.choice.label)
        assert list(k.head_scales) == [float(grid.scales[c, h]) for h in range(len(k.head_scales))]


@pytest.mark.parametrize("passes", ["one", "several", "capped"])
def test_streamed_the_step_weighs_what_it_weighs_in_memory(
    planted, text_dataset, tmp_path, monkeypatch, passes
):
    """--max-memory 0 streams the model and the step; its picks, costs and report equal the in-memory run's, to the
    bit, with one pass over the layers or several (a change at an early layer re-runs the later ones), or capped
    at MAX_PASSES."""
    if passes != "one":
        every_kind_weighed(monkeypatch)
    if passes == "capped":  # the close calls after the first change keep the objective's pick
        monkeypatch.setattr(output, "MAX_PASSES", 1)
    whole = calibrate(planted, str(text_dataset), tmp_path / "whole", CalibrateOptions(**STEP))
    streamed = calibrate(
        planted,
        str(text_dataset),
        tmp_path / "streamed",
        CalibrateOptions(max_memory=0, **STEP),
        Machine.read(CalibrateOptions(max_memory=0), scratch_dir=tmp_path),
    )
    assert any(w.startswith("streaming the model layer by layer") for w in streamed.warnings)
    assert streamed.output_step == whole.output_step and whole.output_step.skipped is None
    assert [to_json(layer) for layer in streamed.layers] == [
        to_json(layer) for layer in whole.layers
    ]
    step = whole.output_step
    if passes == "capped":
        assert step.passes == 1 and step.changed == 1 and step.weighed < 2 * len(whole.layers)
    elif passes == "several":
        assert step.changed >= 2 and step.passes >= 2 and step.weighed == 2 * len(whole.layers)
    else:
        assert step.passes == 1


@pytest.mark.proof("torchrun")
@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
def test_two_processes_weigh_what_one_weighs(planted, text_dataset, tmp_path):
    """Each rank scores its share of the held-out batches; every row's KL is gathered: one process's, to the bit."""
    from helpers import REPO, SUPPORT

    one = calibrate(planted, str(text_dataset), tmp_path / "one", CalibrateOptions(**STEP))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SUPPORT)]), OMP_NUM_THREADS="1"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "kvcalib",
            "calibrate",
            str(planted),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "two"),
            "--num-samples",
            "64",
            "--max-seq-len",
            "64",
            "--batch-size",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout)
    assert one.output_step.weighed >= 1 and two["output_step"] == to_json(one.output_step)
    assert two["layers"] == [to_json(layer) for layer in one.layers]


def test_out_of_memory_in_the_step_leaves_the_objectives_picks(
    planted, text_dataset, tmp_path, monkeypatch
):
    attention = calibrate(
        planted,
        str(text_dataset),
        tmp_path / "attention",
        CalibrateOptions(scale_objective="attention", **STEP),
    )

    def run(*args):
        raise MemoryError("planted")

    monkeypatch.setattr(output._Scorer, "run", run)
    result = calibrate(planted, str(text_dataset), tmp_path / "out", CalibrateOptions(**STEP))
    assert result.validation.ok and (tmp_path / "out" / PROVENANCE_FILENAME).is_file()
    assert [to_json(layer) for layer in result.layers] == [
        to_json(layer) for layer in attention.layers
    ]
    step = result.output_step
    assert step.skipped.startswith("out of memory, MemoryError: planted; a lower --max-memory")
    assert step.material >= 1 and step.forwards == 0
    assert f"the whole-model step did not run ({step.skipped})" in " ".join(result.warnings)


def _faulty_torchrun(mode, planted, text_dataset, out):
    from helpers import REPO, SUPPORT

    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SUPPORT)]), OMP_NUM_THREADS="1"
    )
    args = ["--num-samples", "64", "--max-seq-len", "64", "--batch-size", "4", "--json"]
    return subprocess.run(
        [
            *(
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
            ),
            *(str(SUPPORT / "torchrun_faulty_rank.py"), mode, "calibrate", str(planted)),
            *("--dataset", str(text_dataset), "-o", str(out), *args),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.proof("torchrun")
@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
def test_two_nodes_weigh_what_one_process_weighs(planted, text_dataset, tmp_path):
    """Two torchrun agents (nodes) of one process each meet at a c10d rendezvous, a two-host launch on one
    host, writing to one path: only global rank 0 reports and writes, one process's scales, bit for bit."""
    from helpers import REPO, SUPPORT, scale_bits

    from kvcalib.serving.server import free_port

    one = calibrate(planted, str(text_dataset), tmp_path / "one", CalibrateOptions(**STEP))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SUPPORT)]), OMP_NUM_THREADS="1"
    )
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        tmp_path.name,
        "-m",
        "kvcalib",
        "calibrate",
        str(planted),
        "--dataset",
        str(text_dataset),
        "-o",
        str(tmp_path / "two"),
        *("--num-samples", "64", "--max-seq-len", "64", "--batch-size", "4", "--json"),
    ]
    agents = []
    for n in range(2):  # files, not pipes: a full pipe would stall one node and so both
        with (
            open(tmp_path / f"node{n}.out", "w") as out,
            open(tmp_path / f"node{n}.err", "w") as err,
        ):
            agents.append(subprocess.Popen(node, stdout=out, stderr=err, env=env))
    try:
        codes = [agent.wait(timeout=600) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    errors = [(tmp_path / f"node{n}.err").read_text()[-3000:] for n in range(2)]
    assert codes == [0, 0], errors
    printed = [(tmp_path / f"node{n}.out").read_text() for n in range(2)]
    printed = [out for out in printed if out.strip()]
    assert len(printed) == 1, printed  # one JSON object: only global rank 0 prints
    two = json.loads(printed[0])
    assert two["layers"] == [to_json(layer) for layer in one.layers]
    assert one.output_step.weighed >= 1 and two["output_step"] == to_json(one.output_step)
    assert scale_bits(tmp_path / "two") == scale_bits(tmp_path / "one")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], (
        "no temporary output"
    )


@pytest.mark.proof("torchrun")
@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
def test_a_rank_failing_in_the_step_ends_every_rank_at_once(planted, text_dataset, tmp_path):
    """Rank 1 raises at its first pass over the layers, rank 0 reaches the gather after its own: it reports rank 1's
    error there, not 60 minutes later (COLLECTIVE_TIMEOUT) nor as a lost connection."""
    proc = _faulty_torchrun("step", planted, text_dataset, tmp_path / "out")
    ended = time.time()
    failed_at = float(re.search(r"failing at ([\d.]+)", proc.stderr)[1])
    assert proc.returncode != 0 and ended - failed_at < 60
    assert (
        proc.stderr.count(
            "error: 1 of 2 processes failed during calibration (rank 1: RuntimeError: rank one's "
            "step broke); nothing was written"
        )
        == 1
    ), proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.proof("torchrun")
@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
def test_a_rank_out_of_memory_in_the_step_leaves_every_rank_the_objectives_picks(
    planted, text_dataset, tmp_path
):
    proc = _faulty_torchrun("step-oom", planted, text_dataset, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    skipped = result["output_step"]["skipped"]
    assert skipped.startswith(
        "out of memory, rank 1: MemoryError: rank one's step needs more memory; a lower"
    )
    assert f"the whole-model step did not run ({skipped})" in " ".join(result["warnings"])
    assert (tmp_path / "out" / PROVENANCE_FILENAME).is_file()
