"""The scale objective (kvcalib.calibration.objective): what it chooses, against a brute-force oracle and by
construction."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers import build_tiny_llama
from oracle import calibration_sequences
from planted import build_planted_llama

from kvcalib.calibration import objective
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core import fp8
from kvcalib.core.errors import UsageError
from kvcalib.core.records import to_json
from kvcalib.core.schema import PROVENANCE_FILENAME
from kvcalib.hf.internals import cache_kwargs
from kvcalib.validation.pipeline import validate_checkpoint

SMALL = dict(num_samples=16, max_seq_len=64)


@pytest.fixture(scope="module")
def planted(tmp_path_factory, text_dataset):
    return build_planted_llama(tmp_path_factory.mktemp("planted") / "planted", text_dataset)


@pytest.fixture(scope="module")
def planted_gpu(tmp_path_factory, text_dataset):
    """The same mechanism on the rounding midpoints of the 448 grid."""
    return build_planted_llama(
        tmp_path_factory.mktemp("planted-gpu") / "planted", text_dataset, target="gpu"
    )


class _OneLayerK:
    """Quantises layer 0's K alone (an ObservedCache observer): what one scale choice does to the model."""

    def __init__(self, scale: float, target: fp8.Target):
        self.scale, self.target = scale, target

    def observe(self, layer_idx, key, value):
        return (fp8.fake_quantize(key, self.scale, self.target) if layer_idx == 0 else key), value


def _kl(model, sequences, observer) -> float:
    from kvcalib.hf.attention import ObservedCache

    total, count = 0.0, 0
    with torch.inference_mode():
        for seq in sequences:
            ids = torch.tensor([seq])
            exact = model(input_ids=ids).logits.float().log_softmax(-1)
            quantised = (
                model(
                    input_ids=ids,
                    use_cache=True,
                    **cache_kwargs(
                        model, ObservedCache(model.config, observer.observe, store=False)
                    ),
                )
                .logits.float()
                .log_softmax(-1)
            )
            total += (exact.exp() * (exact - quantised)).sum().item()
            count += len(seq)
    return total / count


def test_the_search_agrees_with_a_brute_force_oracle(planted, text_dataset, tmp_path):
    """Layer 0's K scale chosen by the attention objective against the model's own output, every candidate of
    the grid run through the whole model: absmax is far worse, the choice is as good as the oracle's best."""
    from transformers import AutoModelForCausalLM

    result = calibrate(
        planted,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(scale_objective="attention", **SMALL),
    )
    chosen = result.layers[0]
    assert chosen.k.choice.label != "absmax" and chosen.k.scale < chosen.k.absmax / 240
    target = fp8.get_target("trn2")
    grid = objective.candidates(torch.tensor([chosen.k.absmax]), target, per_head=False)
    model = AutoModelForCausalLM.from_pretrained(planted, dtype=torch.float32).eval()
    sequences = calibration_sequences(planted, text_dataset, 16, 64)[:8]
    kl = {
        label: _kl(model, sequences, _OneLayerK(float(grid.scales[c, 0]), target))
        for c, label in enumerate(grid.labels)
    }
    print({label: round(value, 5) for label, value in kl.items()})
    best = min(kl.values())
    assert kl["absmax"] > 10 * best  # the mechanism: absmax / 240 is the worst scale there is
    assert kl[chosen.k.choice.label] <= 1.5 * best
    assert kl[chosen.k.choice.label] < kl["absmax"] / 10
    # the scale written is the chosen candidate's, sized for its range; validate agrees it is deliberate
    assert chosen.k.scale == float(grid.scales[grid.labels.index(chosen.k.choice.label), 0])
    assert chosen.k.range == float(grid.ranges[grid.labels.index(chosen.k.choice.label), 0])
    report = validate_checkpoint(tmp_path / "out", "trn2")
    assert report.ok and not [f for f in report.findings if f.rule.startswith("RANGE")], (
        report.findings
    )
    provenance = json.loads((tmp_path / "out" / PROVENANCE_FILENAME).read_text())
    assert provenance["scale_objective"] == "attention"
    assert provenance["layers"][0]["k"]["choice"]["label"] == chosen.k.choice.label


def test_a_head_hidden_behind_o_proj_counts_as_the_model_counts_it(planted, text_dataset, tmp_path):
    """The objective scores the attention block's output after o_proj: the planted KV head's V divided by 32 and
    the o_proj columns that read it multiplied by 32 (powers of two: the same model, bit for bit) leave layer 0 K's
    errors and choice as they were. Scored before o_proj, that head's share of the error would be 32 times smaller
    (scripts/make_output_fixture.py builds this on SmolLM2)."""
    import shutil

    from safetensors.torch import load_file, save_file

    hidden = tmp_path / "hidden"
    shutil.copytree(planted, hidden)
    config = json.loads((planted / "config.json").read_text())
    head_dim = config["head_dim"]
    group = config["num_attention_heads"] // config["num_key_value_heads"] * head_dim
    [weights] = hidden.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.v_proj.weight"][:head_dim] /= 32  # KV head 0: the planted one
    tensors["model.layers.0.self_attn.o_proj.weight"][:, :group] *= 32  # its query heads' columns
    save_file(tensors, weights, metadata={"format": "pt"})
    mine, theirs = (
        calibrate(model, str(text_dataset), tmp_path / name, CalibrateOptions(**SMALL)).layers[0].k
        for model, name in ((planted, "planted"), (hidden, "out"))
    )
    assert theirs.choice.label == mine.choice.label != "absmax"
    assert [theirs.choice.attention_error, theirs.choice.attention_error_absmax] == pytest.approx(
        [mine.choice.attention_error, mine.choice.attention_error_absmax], rel=1e-4
    )


def test_the_warning_names_the_layer_the_head_and_the_channels(planted, text_dataset, tmp_path):
    result = calibrate(planted, str(text_dataset), tmp_path / "out", CalibrateOptions(**SMALL))
    [warning] = [w for w in result.warnings if "would cost attention-output error" in w]
    assert warning.startswith("layer 0 K: absmax/240 would cost")
    assert "KV head 0 has near-constant outlier channels: " in warning
    channels = [int(part.split(" (")[0]) for part in warning.split("channels: ")[1].split("), ")]
    assert (
        set(channels) <= set(range(8, 16)) and len(channels) == 6
    )  # the planted first halves of pairs 8..15


def test_absmax_objective_keeps_the_never_clipping_rule(planted, text_dataset, tmp_path):
    result = calibrate(
        planted,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(scale_objective="absmax", **SMALL),
    )
    assert result.scale_objective == "absmax" and result.objective_seconds == 0.0
    for layer in result.layers:
        assert layer.k.choice is None and layer.k.scale == float(
            fp8.scale_from_absmax(layer.k.absmax, fp8.get_target("trn2"))
        )
    assert not [w for w in result.warnings if "attention-output error" in w]
    with pytest.raises(UsageError, match="unknown --scale-objective 'mse'"):
        calibrate(
            planted, str(tmp_path), tmp_path / "x", CalibrateOptions(scale_objective="mse", **SMALL)
        )
    with pytest.raises(UsageError, match="--scale-objective output: not a choice") as refused:
        calibrate(
            planted,
            str(tmp_path),
            tmp_path / "x",
            CalibrateOptions(scale_objective="output", **SMALL),
        )
    assert refused.value.hint == "use --scale-objective attention, or leave the flag out"
    assert not (tmp_path / "x").exists()


def test_per_head_search_clips_only_the_outlier_head(planted_gpu, text_dataset, tmp_path):
    result = calibrate(
        planted_gpu,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(target="gpu", strategy="attn_head", **SMALL),
    )
    layer = result.layers[0]
    absmax_scales = fp8.scale_from_absmax(
        torch.tensor(layer.k.head_absmax), fp8.get_target("gpu")
    ).tolist()
    assert layer.k.head_scales[0] < absmax_scales[0] / 1.5  # the planted head is clipped
    assert layer.k.head_scales[1] == absmax_scales[1]  # the other keeps absmax


def test_stream_engine_chooses_what_the_native_engine_chooses(planted, text_dataset, tmp_path):
    native = calibrate(planted, str(text_dataset), tmp_path / "n", CalibrateOptions(**SMALL))
    streamed = calibrate(
        planted, str(text_dataset), tmp_path / "s", CalibrateOptions(engine="stream", **SMALL)
    )
    assert [to_json(layer) for layer in streamed.layers] == [
        to_json(layer) for layer in native.layers
    ]


def test_a_model_without_the_mechanism_clips_nothing(tmp_path, text_dataset):
    """Scales that are equally good differ by up to ~30 % on a few hundred rows: no clip clears GAIN. What is
    written keeps absmax's range (absmax, or a wider scale a tenth better on both halves) and clips nothing."""
    model = build_tiny_llama(tmp_path / "tiny")
    for target in ("trn2", "gpu"):
        result = calibrate(
            model, str(text_dataset), tmp_path / target, CalibrateOptions(target=target, **SMALL)
        )
        for layer in result.layers:
            for choice in (layer.k.choice, layer.v.choice):
                assert not choice.label.startswith(("absmax x0", "absmax/")), choice
                assert (
                    choice.clipped == 0.0
                    and choice.attention_error <= choice.attention_error_absmax
                )


def test_exact_sums_do_not_depend_on_the_order():
    torch.manual_seed(0)
    terms = [
        torch.randn(2, 4, 13, 2, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (1,)).item()
        for _ in range(7)
    ]
    reference = objective.sum_terms(terms)
    for order in itertools.islice(itertools.permutations(terms), 0, 5040, 97):
        assert torch.equal(objective.sum_terms(list(order)), reference)
    naive = [sum(order) for order in itertools.islice(itertools.permutations(terms), 0, 5040, 97)]
    assert any(
        not torch.equal(naive[0], other) for other in naive
    )  # a plain sum would differ by rank split


CLIPS = (1.0, 0.5, 0.25, 0.125)  # candidates 1-3 clip
WIDER = (1.0, 0.5, 2.0, 4.0)  # candidates 2 and 3 keep absmax's range (a scale at least absmax's)


@pytest.mark.parametrize(
    "errors, held, scales, expected",
    [
        (
            [1.0, 0.9, 0.8, 0.3],
            [1.0, 0.9, 0.8, 0.3],
            CLIPS,
            0,
        ),  # nothing halves the (relative) error: absmax
        # squared errors: 0.15 is within (1 + TOLERANCE)^2 = 1.5625 of the best, 0.1, and clips less
        ([1.0, 0.15, 0.1, 0.1], [1.0, 0.15, 0.1, 0.1], CLIPS, 1),
        ([1.0, 0.2, 0.05, 0.04], [1.0, 0.2, 0.05, 0.04], CLIPS, 2),
        (
            [1.0, 0.1, 0.1, 0.1],
            [1.0, 0.9, 0.1, 0.1],
            CLIPS,
            2,
        ),  # the held-out rows do not confirm candidate 1
        ([1.0, 0.1, 0.1, 0.1], [1.0, 0.9, 0.9, 0.9], CLIPS, 0),  # nor any: absmax
        ([0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], CLIPS, 0),  # no error at all
        # with no clip halving it, a scale that keeps absmax's range must cut the error by a tenth (squared: 0.81) on
        # both halves; the lowest of those wins
        ([1.0, 0.9, 0.8, 0.7], [1.0, 0.9, 0.8, 0.7], WIDER, 3),
        ([1.0, 0.9, 0.8, 0.7], [1.0, 0.9, 0.8, 0.85], WIDER, 2),  # 3 does not on the held-out rows
        ([1.0, 0.9, 0.85, 0.7], [1.0, 0.9, 0.8, 1.1], WIDER, 0),  # neither does on both: absmax
        (
            [1.0, 0.9, 0.82, 0.82],
            [1.0, 0.9, 0.82, 0.82],
            WIDER,
            0,
        ),  # lower, but by less than a tenth: absmax
        # a clip that halves absmax's error comes first, even where a wider scale is as good
        ([1.0, 0.2, 0.2, 0.1], [1.0, 0.2, 0.2, 0.1], WIDER, 1),
    ],
)
def test_the_choice_rule(errors, held, scales, expected):
    """choose, from summed squared errors on the choosing and the held-out rows (and the candidates' scales: which
    keep absmax's range)."""
    scale = torch.tensor(scales)[:, None]
    cands = objective.Candidates(("absmax", "a", "1.0", "b"), scale, scale, scale)
    terms = torch.stack([torch.tensor(errors), torch.tensor(held), torch.zeros(4), torch.ones(4)])[
        :, :, None
    ]
    assert objective.choose(terms.double(), torch.ones(2, 1), cands, per_head=False).index == (
        expected,
    )


def test_each_candidate_is_judged_on_the_server_where_it_does_worst():
    """A trn2 scale is also served at 448 x s: a clip that halves absmax's error on trn2 but not where it does worst
    (a 448-range server, where it no longer saturates) is not chosen; one that does everywhere is."""
    k = objective.candidates(
        torch.tensor([240.0]), fp8.get_target("trn2"), per_head=False, kv_heads=1
    )
    c = len(k.labels)
    trn2, elsewhere = torch.ones(4, c, 1), torch.ones(4, c, 1)
    trn2[:2, 1] = trn2[:2, 3] = (
        0.01  # squared errors: candidates 1 and 3 (clips) far better than absmax on trn2
    )
    elsewhere[:2, 1] = 2.0  # candidate 1 worse than absmax where the clip no longer saturates
    elsewhere[:2, 3] = 0.2  # candidate 3 halves absmax's error there too
    norms = torch.ones(2, 1)
    assert objective.choose(trn2, norms, k, False).index == (1,)  # trn2 alone: the least clipping
    servers = [fp8.get_target(name) for name in ("trn2", "gpu")]
    both = objective.choose(torch.stack([trn2, elsewhere]), norms, k, False, servers)
    assert both.index == (3,) and [name for name, _ in both.choice.attention_error_on] == [
        "trn2",
        "gpu",
    ]
    assert [error for _, error in both.choice.attention_error_on] == pytest.approx(
        [0.1, math.sqrt(0.2)]
    )
    elsewhere[:2, 3] = 0.5  # no clip halves absmax's error everywhere: absmax
    assert objective.choose(torch.stack([trn2, elsewhere]), norms, k, False).index == (0,)


def test_the_wider_candidates_keep_absmaxs_range():
    """1.0 keeps the range only where absmax is under the FP8 max; the wider scales always do, and clip nothing."""
    target = fp8.get_target("trn2")
    for absmax, unit_keeps in ((100.0, True), (300.0, False)):
        grid = objective.candidates(torch.tensor([absmax]), target, per_head=False, kv_heads=2)
        keeps = dict(zip(grid.labels, grid.keeps_range.all(dim=1).tolist()))
        assert keeps["absmax"] and keeps["1.0"] is unit_keeps
        assert [keeps[f"absmax x{f:.4g}"] for f in objective.WIDER] == [True] * 3
        assert not any(
            keeps[label]
            for label in grid.labels
            if label.startswith("absmax x0") or label == "absmax/448"
        )
        wider = torch.tensor([label.startswith("absmax x1") for label in grid.labels])
        assert bool((grid.clip_at[wider] >= absmax).all())


def test_eval_and_validate_see_what_absmax_does(planted, text_dataset, tmp_path):
    """eval's per-layer attention error, and the model's KL with that layer quantised alone, rank the scales as the
    model does, where K SQNR ranks them backwards;
    validate's bias probe warns on the absmax-sized checkpoint and not on the attention objective's."""
    from kvcalib.evaluation.pipeline import EvalOptions, evaluate

    calibrate(planted, str(text_dataset), tmp_path / "attention", CalibrateOptions(**SMALL))
    calibrate(
        planted,
        str(text_dataset),
        tmp_path / "absmax",
        CalibrateOptions(scale_objective="absmax", **SMALL),
    )
    result = evaluate(
        tmp_path / "attention",
        str(text_dataset),
        EvalOptions(num_samples=8, max_seq_len=64, compare=(str(tmp_path / "absmax"),)),
    )
    mine, theirs = (run.layers[0] for run in result.runs)
    assert theirs.attention_error > 4 * mine.attention_error
    assert theirs.k.sqnr_db > mine.k.sqnr_db + 10  # SQNR calls the worse scale the better one
    assert result.runs[1].kl > 4 * result.runs[0].kl
    # quantised alone, layer 0 is what absmax costs the model (KL 0.019 against 0.0005 measured); layer 1 is the same
    assert theirs.kl_alone > 10 * mine.kl_alone
    assert (
        result.runs[1].layers[1].kl_alone
        == result.runs[0].layers[1].kl_alone
        < theirs.kl_alone / 10
    )

    warned = validate_checkpoint(tmp_path / "absmax", "trn2")
    [finding] = [f for f in warned.findings if f.rule == "OUTLIER-K-CHANNELS"]
    assert (
        finding.severity == "warning" and finding.location == "model.layers.0.self_attn.k_proj.bias"
    )
    assert "layer 0 KV head 0: channels " in finding.message and "kvcalib eval" in finding.hint
    assert not [
        f
        for f in validate_checkpoint(tmp_path / "attention", "trn2").findings
        if f.rule.startswith("OUTLIER")
    ]


def test_validate_says_when_it_cannot_tell(tiny_llama, text_dataset, tmp_path):
    calibrate(
        tiny_llama,
        str(text_dataset),
        tmp_path / "absmax",
        CalibrateOptions(scale_objective="absmax", **SMALL),
    )
    [finding] = [
        f
        for f in validate_checkpoint(tmp_path / "absmax", "trn2").findings
        if f.rule.startswith("OUTLIER")
    ]
    assert (
        finding.rule == "OUTLIER-K-UNKNOWN"
        and finding.severity == "info"
        and "kvcalib eval" in finding.hint
    )


@pytest.mark.proof("torchrun")
@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
@pytest.mark.parametrize("engine_args", [[], ["--stream-layers"]], ids=["in-memory", "streamed"])
def test_two_processes_choose_what_one_chooses(engine_args, planted, text_dataset, tmp_path):
    """Every rank scores its own samples; the terms are gathered and summed exactly: the choice, and every
    error the provenance records, are one process's to the bit, and so are the scales written. Only rank 0
    prints and writes; no temporary output is left. (Per head, with Q and streamed, across two processes:
    tests/e2e/test_smollm2.py.)"""

    from helpers import scale_bits, torchrun

    one = calibrate(
        planted, str(text_dataset), tmp_path / "one", CalibrateOptions(batch_size=4, **SMALL)
    )
    proc = torchrun(
        "-m",
        "kvcalib",
        "calibrate",
        str(planted),
        "--dataset",
        str(text_dataset),
        "-o",
        str(tmp_path / "two"),
        "--num-samples",
        "16",
        "--max-seq-len",
        "64",
        "--batch-size",
        "4",
        *engine_args,
        "--json",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout)  # one JSON object: only rank 0 prints
    assert two["layers"] == [to_json(layer) for layer in one.layers]
    assert two["layers"][0]["k"]["choice"]["label"] != "absmax"
    assert two["num_samples"] == 16 and two["num_tokens"] == one.num_tokens
    assert scale_bits(tmp_path / "two") == scale_bits(tmp_path / "one")
    assert proc.stderr.count("KV scales for trn2") == 1 and proc.stderr.count("validation: ok") == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], (
        "no temporary output left"
    )


def _sample(
    length: int, seed: int, sinks: bool = False, softcap: float | None = None, outlier: bool = False
):
    """outlier: K head 0's channel 0 near-constant at 232, a rounding midpoint of the grid absmax (240) gives on
    trn2, and query heads 0-1 reading it: the mechanism a clip fixes."""
    from kvcalib.hf.samples import AttentionSample

    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor([0, length // 3, length // 2, length - 1])
    causal = torch.arange(length)[None, :] <= rows[:, None]
    query, key = (
        torch.randn(4, len(rows), 8, generator=g) * 3,
        torch.randn(2, length, 8, generator=g) * 20,
    )
    if outlier:
        key[0, :, 0] = 232.0 + torch.randn(length, generator=g)
        key[0, 0, 1] = 240.0
        query[:2, :, 0] = 3.0
    return AttentionSample(
        query=query,
        key=key,
        value=torch.randn(2, length, 8, generator=g),
        bias=torch.zeros(causal.shape).masked_fill(~causal, float("-inf")),
        held_out=torch.tensor([False, True, False, True]),
        scaling=8**-0.5,
        softcap=softcap,
        sinks=torch.randn(4, generator=g) if sinks else None,
    )


@pytest.mark.parametrize("target", ["trn2", "gpu"])
def test_the_terms_are_each_candidates_own_attention(target):
    """sample_terms scores every candidate at once, on every server its scales meet: each candidate's terms are
    what quantising K (then V) with it alone, as that server does, and recomputing the rows' attention give, and the
    elements it saturates there are counted exactly (samples of different lengths, soft-capping, sinks)."""
    from kvcalib.hf.samples import attention_rows

    chip = fp8.get_target(target)
    numerics = objective.scored_numerics(chip, per_head=False)
    for sample in (_sample(40, 0), _sample(17, 1, sinks=True), _sample(64, 2, softcap=5.0)):
        k = objective.candidates(sample.key.abs().amax(dim=(1, 2)), chip, per_head=True)
        v = objective.candidates(
            sample.value.abs().amax(dim=(1, 2)), chip, per_head=False, kv_heads=2
        )
        grids = [(k.on(n), v.on(n)) for n in numerics]
        terms, norms = objective.sample_terms(sample, grids, numerics)
        reference, probabilities = attention_rows(sample)
        held = sample.held_out.repeat(2)
        # float32 products batched differently may differ in the last bits on another CPU: far below any
        # candidate's error, so compared to a millionth of the output's squared norm
        slack = 1e-6 * float(reference.double().pow(2).sum())
        for n, server in enumerate(numerics):
            for kind, (values, cands) in enumerate(zip((sample.key, sample.value), grids[n])):
                for c in range(cands.scales.shape[0]):
                    quantised = fp8.fake_quantize(values, cands.scales[c][:, None, None], server)
                    output, _ = attention_rows(
                        sample, **({"key": quantised} if kind == 0 else {"value": quantised})
                    )
                    error = (output - reference).double().pow(2).sum(dim=-1)  # [Hkv, rows]
                    assert terms[n, kind, 0, c].tolist() == pytest.approx(
                        error[:, ~held].sum(-1).tolist(), rel=1e-5, abs=slack
                    )
                    assert terms[n, kind, 1, c].tolist() == pytest.approx(
                        error[:, held].sum(-1).tolist(), rel=1e-5, abs=slack
                    )
                    saturated = (values.abs() > cands.clip_at[c][:, None, None]).sum(dim=(1, 2))
                    assert terms[n, kind, 2, c].tolist() == saturated.tolist()
                assert set(terms[n, kind, 3].flatten().tolist()) == {
                    float(values.shape[1] * values.shape[2])
                }
        squares = reference.double().pow(2).sum(-1)
        assert norms.flatten().tolist() == pytest.approx(
            squares[:, ~held].sum(-1).tolist() + squares[:, held].sum(-1).tolist(), rel=1e-6
        )
        assert probabilities.shape == (2, 8, sample.key.shape[1])


@pytest.mark.parametrize("target", ["trn2", "gpu", "vllm-cpu"])
def test_candidates_ruled_out_early_change_nothing(target):
    """search stops scoring a candidate once its error so far reaches the bar absmax's whole error sets: every
    choice, error and clipped fraction is that of scoring every candidate on every sample, per tensor and per head
    (clips, wider scales and absmax among them), each recorded on every numerics it was scored on."""
    chip = fp8.get_target(target)
    layers = [
        [
            _sample(
                48, 10 * i + j, sinks=i == 3, softcap=5.0 if i == 2 else None, outlier=i % 2 == 0
            )
            for j in range(5)
        ]
        for i in range(4)
    ]
    k_heads = [
        torch.stack([s.key.abs().amax(dim=(1, 2)) for s in layer]).amax(dim=0) for layer in layers
    ]
    v_heads = [
        torch.stack([s.value.abs().amax(dim=(1, 2)) for s in layer]).amax(dim=0) for layer in layers
    ]
    labels = set()
    for per_head in (False, True):
        numerics = objective.scored_numerics(chip, per_head)  # each server these scales are for
        assert numerics == ((chip,) if per_head else fp8.served_numerics(chip))
        everything = []
        for layer, k_absmax, v_absmax in zip(layers, k_heads, v_heads):
            k = objective.candidates(k_absmax, chip, per_head)
            v = objective.candidates(v_absmax, chip, per_head)
            pairs = [
                objective.sample_terms(s, [(k.on(n), v.on(n)) for n in numerics], numerics)
                for s in layer
            ]
            terms, norms = (
                objective.sum_terms([t for t, _ in pairs]),
                objective.sum_terms([n for _, n in pairs]),
            )
            everything.append(
                tuple(
                    objective.choose(terms[:, kind], norms, cands, per_head, numerics)
                    for kind, cands in enumerate((k, v))
                )
            )
        chosen = [found[:2] for found in objective.search(layers, k_heads, v_heads, chip, per_head)]
        # the same choices and clipped counts; the errors, of float32 products batched by other candidate counts,
        # to a millionth (another CPU's kernels may order their sums differently)
        for found, whole in zip(chosen, everything):
            for mine, theirs in zip(found, whole):
                a, b = mine.choice, theirs.choice
                assert (mine.index, a.label, a.clipped) == (theirs.index, b.label, b.clipped)
                errors = ("attention_error", "attention_error_absmax", "attention_error_unit")
                assert [getattr(a, e) for e in errors] == pytest.approx(
                    [getattr(b, e) for e in errors], rel=1e-6
                )
                assert [name for name, _ in a.attention_error_on] == [n.name for n in numerics]
        labels |= {c.choice.label for pair in chosen for c in pair}
    if (
        target == "gpu"
    ):  # (on trn2 what helps is worse than absmax on vLLM CPU here: absmax is chosen)
        assert {"absmax", "per head"} <= labels  # absmax, and per head a mix
        assert any(label.startswith("absmax x1") for label in labels)  # a wider scale
