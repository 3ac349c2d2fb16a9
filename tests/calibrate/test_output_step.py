"""The whole-model step (kvcalib.calibration.output): its decision rule by construction, and on the planted tiny
Llama (near-constant K channels in layer 0) in every engine: in memory, streamed, per head, under torchrun; out of
memory (the objective's picks stand) and a rank failing in it (every rank ends at once)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from planted import build_planted_llama, every_kind_weighed

from kvcalib.calibration import objective, output
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.output import decide, held_out_rows
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core import fp8
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
        k.choice["step"] == "output"
        and "absmax" in k.choice["output"]
        and len(k.choice["output"]) >= 2
    )
    grid = objective.candidates(torch.tensor([k.absmax]), fp8.get_target("trn2"), per_head=False)
    assert k.scale == float(
        grid.scales[grid.labels.index(k.choice["label"]), 0]
    )  # the written scale is the pick's
    provenance = json.loads((tmp_path / "out" / PROVENANCE_FILENAME).read_text())
    assert provenance["scale_objective"] == "output"
    assert provenance["layers"][0]["k"]["choice"] == k.choice
    assert result.to_dict()["output_step"]["weighed"] == step.weighed


def test_per_head_scales_are_weighed_per_head(planted, text_dataset, tmp_path):
    result = calibrate(
        planted,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(target="gpu", strategy="attn_head", **STEP),
    )
    [k] = [s for layer in result.layers for s in (layer.k, layer.v) if s.choice.get("output")]
    assert (
        result.output_step.weighed == 1 and k.choice["step"] == "output" and len(k.head_scales) == 2
    )
    grid = objective.candidates(torch.tensor(k.head_absmax), fp8.get_target("gpu"), per_head=True)
    assert len(k.choice["output"]) >= 2 and all(
        isinstance(kl, float) for kl in k.choice["output"].values()
    )
    if (
        k.choice["label"] != "per head"
    ):  # one candidate on every head: each head's scale is that candidate's
        c = grid.labels.index(k.choice["label"])
        assert list(k.head_scales) == [float(grid.scales[c, h]) for h in range(len(k.head_scales))]


@pytest.mark.parametrize("passes", ["one", "several"])
def test_streamed_the_step_weighs_what_it_weighs_in_memory(
    planted, text_dataset, tmp_path, monkeypatch, passes
):
    """--max-memory 0 streams the model and the step; its picks, costs and report equal the in-memory run's, to the
    bit, with one pass over the layers or several (a change at an early layer re-runs the later ones)."""
    if passes == "several":
        every_kind_weighed(monkeypatch)
    whole = calibrate(planted, str(text_dataset), tmp_path / "whole", CalibrateOptions(**STEP))
    streamed = calibrate(
        planted,
        str(text_dataset),
        tmp_path / "streamed",
        CalibrateOptions(max_memory=0, scratch_dir=tmp_path, **STEP),
    )
    assert any(w.startswith("streaming the model layer by layer") for w in streamed.warnings)
    assert streamed.output_step == whole.output_step and whole.output_step.skipped is None
    assert [layer.to_dict() for layer in streamed.layers] == [
        layer.to_dict() for layer in whole.layers
    ]
    step = whole.output_step
    if passes == "several":
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
    assert one.output_step.weighed >= 1 and two["output_step"] == one.output_step.to_dict()
    assert two["layers"] == [layer.to_dict() for layer in one.layers]


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
    assert [layer.to_dict() for layer in result.layers] == [
        layer.to_dict() for layer in attention.layers
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
