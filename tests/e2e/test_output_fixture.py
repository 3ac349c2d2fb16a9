"""The whole-model step on real weights: SmolLM2 built so that the attention objective's pick is worse at the output
than a deeper clip (scripts/make_output_fixture.py), calibrated both ways, scored by eval on held-out text and
checked against a brute force over layer 0 K's candidates, gpu numerics.

Layer 0 K's KV head 1 has near-constant channels on absmax's FP8 rounding boundaries (absmax flips them, every clip
saturates them); KV head 0 has them on the boundaries of absmax x0.7071, the least clipping candidate, and its V
divided by 32 (o_proj x 32: the same model), so the attention objective, which scores ||ΔO|| / ||O|| before o_proj,
barely sees them. The objective picks x0.7071; the step weighs it against the 2 lowest attention errors and finds a
deeper clip, which saturates head 0's channels too."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fortune_texts, import_script, write_jsonl

from kvcalib.calibration import objective
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core import fp8
from kvcalib.core.checkpoint import Checkpoint
from kvcalib.evaluation.emulate import KVQuantizer
from kvcalib.evaluation.layers import OneLayer
from kvcalib.evaluation.pipeline import EvalOptions, evaluate, log_probs
from kvcalib.evaluation.significance import paired_bootstrap
from kvcalib.hf.compute import Float32Weights
from kvcalib.hf.model import load_model, load_tokenizer, resolve_compute

pytestmark = pytest.mark.slow
CALIBRATION = dict(num_samples=16, max_seq_len=256)
FAST = dict(bf16_compute="float32")
OBJECTIVES_PICK = "absmax x0.7071"


def _oracle(fixture, texts, result, target):
    """Per candidate of layer 0 K's grid (every other scale as `result` calibrated it): per-row summed next-token KL
    against the unquantised run, and the rows' token counts."""
    checkpoint = Checkpoint.open(fixture)
    model = load_model(checkpoint, None, torch.device("cpu"), False)
    compute = resolve_compute("float32", None, checkpoint, torch.device("cpu"), None)
    tokenizer = load_tokenizer(checkpoint.root, False)
    rows = [tokenizer(t)["input_ids"][:256] for t in texts]
    ids = torch.tensor([r[: min(map(len, rows))] for r in rows])
    mask, weights = torch.ones_like(ids), Float32Weights()
    with torch.no_grad():
        reference = log_probs(
            model, ids, mask, OneLayer(None, None), compute=compute, weights=weights
        )  # no hook
        k, v = (
            [layer.k.scale for layer in result.layers],
            [layer.v.scale for layer in result.layers],
        )
        absmax, costs = result.layers[0].k.absmax, {}
        grid = [
            (
                "absmax" if f == 1.0 else f"absmax x{f:.4g}",
                float(fp8.scale_from_absmax(absmax * f, target)),
            )
            for f in sorted({*objective.FACTORS, *objective.WIDER}, reverse=True)
        ]
        for label, scale in [*grid, (objective.UNIT_LABEL, 1.0)]:
            k[0] = scale
            logq = log_probs(
                model, ids, mask, KVQuantizer(k, v, target), compute=compute, weights=weights
            )
            costs[label] = (reference.exp() * (reference - logq)).sum(-1).sum(-1).double().tolist()
    return costs, [float(ids.shape[1] - 1)] * len(rows)


def _interval(interval):
    return f"{interval.estimate:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]"


def test_the_output_step_overrules_what_the_attention_objective_cannot_see(smollm2, tmp_path):
    make_output_fixture, make_text_dataset = (
        import_script("make_output_fixture"),
        import_script("make_text_dataset"),
    )
    calibration = write_jsonl(
        tmp_path / "fortunes.jsonl", [{"text": t} for t in fortune_texts(64, chars=2000)]
    )
    paragraphs = make_text_dataset.join_entries(make_text_dataset.tutorial_paragraphs(), 2000, 8)
    held_out = write_jsonl(tmp_path / "tutorial.jsonl", [{"text": t} for t in paragraphs])
    fixture = tmp_path / "smollm2-hidden-head"
    make_output_fixture.make(smollm2, fixture, str(calibration), **CALIBRATION, **FAST)
    options = dict(target="gpu", **CALIBRATION, **FAST)

    attention = calibrate(
        fixture,
        str(calibration),
        tmp_path / "attention",
        CalibrateOptions(scale_objective="attention", **options),
    )
    default = calibrate(
        fixture, str(calibration), tmp_path / "default", CalibrateOptions(**options)
    )
    theirs, mine = attention.layers[0].k.choice, default.layers[0].k.choice
    kl = dict(mine.output)
    print(
        "layer 0 K: attention objective",
        theirs.label,
        "error",
        round(theirs.attention_error, 3),
        "(absmax",
        round(theirs.attention_error_absmax, 3),
        "); step",
        mine.label,
        "KL",
        kl,
    )
    # measured: the objective x0.7071 (attention error 0.372, absmax 0.759); the step's KL on the held-out calibration
    # rows x0.7071 0.349, x0.25 0.057, x0.04419 0.058, absmax 0.670: x0.25 (the least clipping of the two it ties)
    assert (
        theirs.label == OBJECTIVES_PICK and mine.label != OBJECTIVES_PICK and mine.step == "output"
    )
    assert kl[OBJECTIVES_PICK] > 3 * kl[mine.label]
    assert default.output_step.changed >= 1

    result = evaluate(
        tmp_path / "default",
        str(held_out),
        EvalOptions(
            target="gpu",
            num_samples=4,
            max_seq_len=256,
            compare=(str(tmp_path / "attention"),),
            layer_rows=0,
            **FAST,
        ),
    )
    runs = {run.name: run for run in result.runs}
    ours, objectives = (
        runs["checkpoint"].delta_nll_interval,
        runs[str(tmp_path / "attention")].delta_nll_interval,
    )
    print(
        f"ΔNLL on {result.num_tokens} tutorial tokens ({result.order} order): default {ours.verdict()}, "
        f"attention objective {objectives.verdict()}"
    )
    # measured (1,020 tokens, gpu order): default -0.0038 [-0.0148, +0.0056], attention objective +0.332 [+0.191,
    # +0.477]
    assert objectives.low > ours.high and objectives.estimate > 3 * max(ours.estimate, 0.01)

    target = fp8.get_target("gpu")
    costs, tokens = _oracle(fixture, paragraphs[:4], default, target)
    total = math.fsum(tokens)
    mean = {label: math.fsum(c) / total for label, c in costs.items()}
    best = min(mean, key=mean.get)
    step_gap = paired_bootstrap([a - b for a, b in zip(costs[mine.label], costs[best])], tokens)
    objective_gap = paired_bootstrap(
        [a - b for a, b in zip(costs[OBJECTIVES_PICK], costs[best])], tokens
    )
    print("oracle KL per layer 0 K candidate:", {label: round(m, 4) for label, m in mean.items()})
    print(
        f"oracle best {best}; KL minus the best's: the step's {mine.label} {_interval(step_gap)}, "
        f"the objective's {OBJECTIVES_PICK} {_interval(objective_gap)}"
    )
    # measured (4 tutorial rows, 1,020 tokens): best x0.125 0.0446 (x0.5 down to x0.03125, and 1.0: 0.045-0.048);
    # the step's x0.25 +0.0006 [-0.0012, +0.0030]; the objective's x0.7071 +0.278 [+0.172, +0.374]; absmax 0.568
    assert best == mine.label or step_gap.low <= 0.0
    assert best != OBJECTIVES_PICK and objective_gap.low > 10 * max(step_gap.high, 0.001)
