"""eval: predict FP8-KV accuracy on CPU (or GPU) with the target chip's own numerics.

Each batch of held-out text runs once with an unquantised KV cache (the baseline) and once per scale configuration
with K/V quantised as the chip stores them (fp8.fake_quantize through kvcalib.hf.attention's hook), teacher-forced in
the server's order (--order, fp8.Target.order): GPU, every position reads the FP8 cache; Neuron, a row's first half
is a prefill on fresh K/V, the decode steps that follow (alone scored) read FP8 (emulate.FreshPrefill; chunked, the
prompt in pieces; mxfp8, decode over Trainium 3's MXFP8 cache). Against the
baseline, on the same predictions: NLL, ΔNLL, KL, top-1 agreement; per layer, on the unquantised K/V: SQNR, clipping.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvcalib.core import fp8
from kvcalib.core.checkpoint import Checkpoint, read_config, scan_checkpoint
from kvcalib.core.choice import ScaleChoice
from kvcalib.core.cpu import ComputePath, HostCpu
from kvcalib.core.errors import UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.core.schema import NEURON_PER_HEAD_REASON, head_counts, num_hidden_layers
from kvcalib.evaluation.emulate import (
    FreshPrefill,
    KVErrorMeter,
    KVQuantizer,
    LayerQuantStats,
    decode_rows,
    is_per_head,
)
from kvcalib.evaluation.options import EvalOptions
from kvcalib.evaluation.scales import ScaleSet, read_scale_set
from kvcalib.evaluation.scoring import log_probs
from kvcalib.evaluation.significance import Interval, paired_bootstrap
from kvcalib.hf.compute import Float32Weights
from kvcalib.hf.data import batches, load_calibration_data
from kvcalib.hf.model import (
    PreparedRun,
    faithful_attention,
    load_model,
    load_tokenizer,
    prepare_run,
    resolve_compute,
    resolve_target,
)
from kvcalib.hf.samples import AttentionSampler, sample_sequences
from kvcalib.validation.provenance import read_provenance

__all__ = [
    "CHECKPOINT",
    "UNIT",
    "EvalOptions",
    "EvalResult",
    "Prepared",
    "RunResult",
    "evaluate",
    "prepare_scales",
    "scale_set",
]

UNIT = "unit"  # --compare unit: every scale 1.0 (what a checkpoint without scales runs with)
CHECKPOINT = "checkpoint"
FP8_ATTN = " +fp8-attn"  # the name of a scale set's FP8-attention run: its name and this


@dataclass(frozen=True)
class RunResult:
    """One scale set in EvalResult's runs: name ("checkpoint", "unit" or a --compare path), kind; per scored token
    against the unquantised run: nll, ppl, delta_nll, kl (nats), top1 (agreement with its top-1), accuracy (fractions);
    delta_nll_interval, delta_accuracy_interval (Interval; null: < 2 rows); layers (LayerQuantStats)."""

    name: str
    nll: float
    delta_nll: float
    kl: float
    top1: float
    layers: tuple[LayerQuantStats, ...]
    kind: (
        str  # "KV per-tensor", "KV per-head", "FP8 attn, per-tensor" (Q too), "FP8 attn, per-head"
    )
    accuracy: (
        float  # next-token top-1 accuracy (top1 is the agreement with the unquantised run's top-1)
    )
    delta_nll_interval: Interval | None  # paired over rows (None: < 2 rows)
    delta_accuracy_interval: Interval | None
    # every scored token's NLL, row after row (float64; not in its JSON): serve-check pairs them with the server's
    token_nll: torch.Tensor = field(compare=False, repr=False)

    @property
    def k_clipped(self) -> float:
        return sum(s.k.clipped for s in self.layers) / len(self.layers)

    @property
    def v_clipped(self) -> float:
        return sum(s.v.clipped for s in self.layers) / len(self.layers)

    JSON = {"token_nll": None, "ppl": lambda r: math.exp(r.nll)}


@dataclass(frozen=True)
class EvalResult:
    """What `eval --dataset` measured; to_json() is its --json: checkpoint, target, fp8_max, order (neuron: only the
    decode steps after a fresh-K/V prefill of each row's first half are scored; gpu: every position reads FP8), compute,
    num_samples, num_tokens, baseline (the unquantised run's nll, ppl, accuracy), runs (RunResult), seconds, plot,
    layer_rows."""

    checkpoint: str
    target: str
    fp8_max: float
    order: str
    num_samples: int
    num_tokens: int  # next-token predictions scored
    baseline_nll: float
    baseline_accuracy: float  # next-token top-1 accuracy of the unquantised run
    runs: tuple[RunResult, ...]
    seconds: float
    compute: str
    layer_rows: int  # rows the per-layer ΔNLL (LayerQuantStats.delta_nll_alone) was measured on
    baseline_token_nll: torch.Tensor = field(compare=False, repr=False)  # as RunResult's
    plot: str | None = None

    JSON = {
        "baseline_nll": None,
        "baseline_accuracy": None,
        "baseline_token_nll": None,
        "baseline": lambda r: {
            "nll": r.baseline_nll,
            "ppl": math.exp(r.baseline_nll),
            "accuracy": r.baseline_accuracy,
        },
    }


@dataclass
class _Totals:
    """One configuration's scored tokens: per row, their NLLs (float64) and how many its top-1 got right; against
    the baseline, Σ KL(baseline || this) and Σ agreement with its top-1."""

    token_nll: list[torch.Tensor] = field(default_factory=list)
    row_correct: list[float] = field(default_factory=list)
    kl: float = 0.0
    agree: float = 0.0

    def add(
        self,
        logp: torch.Tensor,
        targets: torch.Tensor,
        scored: torch.Tensor,
        base: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One batch's next-token log-probabilities [B, S-1, V] against `targets` [B, S-1] (and the baseline's
        log-probabilities and top-1, `base`); returns the top-1."""
        token_nll, top1 = -logp.gather(-1, targets[..., None])[..., 0], logp.argmax(-1)
        self.row_correct += ((top1 == targets) & scored).sum(1).tolist()
        values, masks = token_nll.double().cpu(), scored.cpu()  # one transfer a batch
        self.token_nll += [row[mask] for row, mask in zip(values, masks)]
        if base is not None:
            kl = (base[0].exp() * (base[0] - logp)).sum(-1)  # KL(baseline || this) per position
            self.kl += kl[scored].double().sum().item()
            self.agree += (top1 == base[1])[scored].sum().item()
        return top1

    @property
    def row_nll(self) -> list[float]:
        return [float(row.sum()) for row in self.token_nll]

    @property
    def nll(self) -> float:
        return sum(self.row_nll)

    @property
    def count(self) -> int:
        return sum(len(row) for row in self.token_nll)


def evaluate(
    checkpoint: str | Path,
    dataset: str,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
) -> EvalResult:
    """Evaluate `checkpoint`'s KV scales (and `options.compare`) against an unquantised KV cache."""
    opts = options or EvalOptions()
    notify = progress or no_progress
    started = time.perf_counter()
    job = prepare_scales(checkpoint, opts)
    order = opts.order or job.target.order
    fresh = order != fp8.GPU_ORDER

    notify(Progress("load-data"))
    data = load_calibration_data(dataset, job.tokenizer(), opts)
    if sum(len(s) // 2 - 1 if fresh else len(s) - 1 for s in data.sequences) < 1:
        raise UsageError(
            f"the evaluation samples are all {'under 4 tokens' if fresh else 'one token'} long: "
            f"nothing to score in the {order} order",
            hint="pass longer texts or a larger --max-seq-len"
            + (", or --order gpu" if fresh else ""),
        )
    sampler = AttentionSampler(
        job.quantizers[CHECKPOINT].num_layers,
        sample_sequences(data.sequences, opts.batch_size),
    )
    meter = KVErrorMeter(job.quantizers, job.run.device, sampler)
    forward = functools.partial(
        log_probs, job.model(notify), compute=job.compute, weights=Float32Weights()
    )
    score = functools.partial(
        _score,
        forward,
        notify=notify,
        batch_size=opts.batch_size,
        device=job.run.device,
        order=order,
    )
    baseline, totals = score(data.sequences, job.quantizers, meter=meter)
    # (the MXFP8 cache uses no per-tensor scale: no layer is quantised alone)
    rows = data.sequences[: 0 if order == fp8.MXFP8_ORDER else opts.layer_rows]
    tokens = [len(r) for r in baseline.token_nll]
    # per layer, (ΔNLL, KL) with only that layer's K/V quantised, on `rows` (no FP8 attention run). A per-layer error
    # figure (SQNR, attention error) says how far the values move, not what that costs the prediction (a
    # near-constant K channel can make SQNR rank scales backwards); KL is the steadier on few tokens. Layers
    # interact, so these need not add up.
    plain = {name: q for name, q in job.quantizers.items() if not q.fp8_attention}
    layers, alone = range(meter.num_layers), {}
    if rows:
        hooks = {(name, i): replace(q, only=i) for name, q in plain.items() for i in layers}
        base, each = score(rows, hooks, stage="layers-alone")
        n = max(base.count, 1)
        alone = {
            name: [((each[name, i].nll - base.nll) / n, each[name, i].kl / n) for i in layers]
            for name in plain
        }
    runs = []
    for name, t in totals.items():
        n, quantizer = t.count, job.quantizers[name]
        stats = _chosen(meter.layer_stats(name, alone.get(name)), job.run.checkpoint.root, name)
        heads = "per-head" if is_per_head(quantizer.k_scales, quantizer.v_scales) else "per-tensor"
        runs.append(
            RunResult(
                name,
                t.nll / n,
                (t.nll - baseline.nll) / n,
                t.kl / n,
                t.agree / n,
                stats,
                f"FP8 attn, {heads}" if quantizer.fp8_attention else f"KV {heads}",
                sum(t.row_correct) / n,
                # paired over rows: ΔNLL per token, the change in next-token accuracy
                paired_bootstrap([q - b for q, b in zip(t.row_nll, baseline.row_nll)], tokens),
                paired_bootstrap(
                    [q - b for q, b in zip(t.row_correct, baseline.row_correct)],
                    tokens,
                    worse_if_higher=False,
                ),
                torch.cat(t.token_nll),  # evaluate scores one row at least
            )
        )
    return EvalResult(
        str(checkpoint),
        job.target.name,
        job.target.fp8_max,
        order,
        len(data.sequences),
        baseline.count,
        baseline.nll / baseline.count,
        sum(baseline.row_correct) / baseline.count,
        tuple(runs),
        time.perf_counter() - started,
        job.compute.describe(),
        len(rows),
        torch.cat(baseline.token_nll),
    )


def _chosen(stats: list[LayerQuantStats], root: Path, name: str) -> tuple[LayerQuantStats, ...]:
    """`stats` with what kvcalib's scale objective chose per layer, where the run's checkpoint provenance says."""
    base = name.removesuffix(FP8_ATTN)
    source = root if base == CHECKPOINT else None if base == UNIT else Path(base)
    provenance = source and read_provenance(scan_checkpoint(source, tolerant=True))
    chosen = {}
    for entry in (provenance or {}).get("layers") or ():
        try:  # a provenance kvcalib did not write, or an older one: the layer shows no choice
            chosen[entry["layer"]] = {
                kind: ScaleChoice(str(c["label"]))
                for kind in "kv"
                if kind in entry and (c := entry[kind]["choice"])
            }
        except (KeyError, TypeError, AttributeError):
            continue
    return tuple(replace(s, chosen=chosen[s.layer]) if s.layer in chosen else s for s in stats)


@dataclass(frozen=True)
class Prepared:
    """An eval job's inputs, checked before data or model: the checkpoint (PreparedRun), how it computes, and,
    for evaluate, context and needle, the target and a quantiser per scale set (the checkpoint's, then --compare's)."""

    run: PreparedRun
    compute: ComputePath
    trust_remote_code: bool
    target: fp8.Target | None = None
    quantizers: dict[str, KVQuantizer] = field(default_factory=dict)

    @classmethod
    def open(cls, checkpoint: str | Path, opts: Any, cpu: HostCpu | None = None) -> Prepared:
        """The checkpoint found and checked, the compute path for `opts` (ModelOptions) on `cpu`."""
        run = prepare_run(checkpoint, opts)
        compute = resolve_compute(opts.bf16_compute, run.dtype, run.checkpoint, run.device, cpu)
        return cls(run, compute, opts.trust_remote_code)

    def tokenizer(self) -> Any:
        return load_tokenizer(self.run.checkpoint.root, self.trust_remote_code)

    def model(self, notify: ProgressCallback = no_progress) -> torch.nn.Module:
        """The one way every eval job loads the model: in its dtype and device, attention as it serves."""
        notify(Progress("load-model"))
        run = self.run
        attention = faithful_attention(run.checkpoint.config)
        return load_model(run.checkpoint, run.dtype, run.device, self.trust_remote_code, attention)


def prepare_scales(checkpoint: str | Path, opts: EvalOptions) -> Prepared:
    """The checkpoint, a quantiser per scale set and the compute path: all eval checks before data or model."""
    opts.check_arguments()
    target = resolve_target(opts.target)
    job = Prepared.open(checkpoint, opts)
    configs = {}
    for entry in (CHECKPOINT, *opts.compare):  # the checkpoint's own scales, then each --compare
        if entry in configs:
            raise UsageError(f"--compare {entry} given twice", hint="name each comparison once")
        configs[entry] = scale_set(entry, job.run.checkpoint, target)
    quantizers = {name: KVQuantizer(s.k, s.v, target) for name, s in configs.items()}
    if opts.fp8_attention:  # one more run for each that has q_scale
        quantizers |= {
            name + FP8_ATTN: KVQuantizer(s.k, s.v, target, s.q, fp8_attention=True)
            for name, s in configs.items()
            if s.q is not None
        }
        if len(quantizers) == len(configs):
            raise UsageError(
                "--fp8-attention needs q_scale, and no checkpoint evaluated has one",
                hint="calibrate with kvcalib calibrate --attention-scales",
            )
    return replace(job, target=target, quantizers=quantizers)


def _score(
    forward: Callable[..., torch.Tensor],
    sequences: list[list[int]],
    hooks: dict[Any, Any],
    *,
    notify: ProgressCallback,
    batch_size: int,
    device: torch.device,
    order: str,
    meter: KVErrorMeter | None = None,
    stage: str = "observe",
) -> tuple[_Totals, dict[Any, _Totals]]:
    """Every batch unquantised (the baseline; `meter` rides along) and once per K/V hook in `order` (in all but the
    GPU order after a prefill); the baseline's totals and each hook's."""
    baseline, totals = _Totals(), {key: _Totals() for key in hooks}
    done_samples = done_tokens = 0
    num_tokens = sum(len(s) for s in sequences)
    notify(Progress(stage, 0, len(sequences), 0, num_tokens))
    for input_ids, mask in batches(sequences, batch_size):  # padding is masked: any id does
        input_ids, mask = input_ids.to(device), mask.to(device)
        scored, targets = (mask[:, 1:] & mask[:, :-1]).bool(), input_ids[:, 1:]  # real from real
        if order != fp8.GPU_ORDER:  # after a prefill: the decode steps only
            scored &= decode_rows(mask)[:, :-1]
        if meter:  # evaluate's meter has a sampler
            meter.token_mask = mask.bool()
            meter.sampler.start_batch(input_ids, mask)
        base_logp = forward(input_ids, mask, meter)
        base = (base_logp, baseline.add(base_logp, targets, scored))
        for key, hook in hooks.items():
            logp = forward(input_ids, mask, _in_order(hook, mask, order))
            totals[key].add(logp, targets, scored, base)
            del logp
        done_samples += input_ids.shape[0]
        done_tokens += int(mask.sum())
        notify(Progress(stage, done_samples, len(sequences), done_tokens, num_tokens))
    return baseline, totals


def _in_order(hook: KVQuantizer, mask: torch.Tensor, order: str) -> Any:
    """`hook` as the attention hook that reads the K/V in `order` (fp8.ORDERS) for a batch with this [B, S] mask."""
    if order == fp8.GPU_ORDER:
        return hook
    chunk = fp8.PREFILL_CHUNK if order == fp8.NEURON_CHUNKED_ORDER else None
    return FreshPrefill(hook, mask, chunk, mxfp8=order == fp8.MXFP8_ORDER)


def _config_num_layers(config: dict[str, Any], where: Path) -> int:
    layers = num_hidden_layers(config)
    if layers is None:
        raise UsageError(
            f"{where}: config.json has no usable num_hidden_layers",
            hint=f"run `kvcalib validate {where}`",
        )
    return layers


def scale_set(
    entry: str, checkpoint: Checkpoint, target: fp8.Target, what: str | None = None
) -> ScaleSet:
    """One configuration's scales: CHECKPOINT (the checkpoint's own), UNIT (every scale 1.0) or another checkpoint's
    path (of the same model: as many layers), per tensor or per head; per-head scales refused for Neuron.
    `what` names the entry in messages (default "--compare ENTRY")."""
    root, config = checkpoint.root, checkpoint.config
    layers = _config_num_layers(config, root)
    if entry == UNIT:
        return ScaleSet([1.0] * layers, [1.0] * layers, None)
    source = root if entry == CHECKPOINT else Path(entry)
    if source != root and (other := _config_num_layers(read_config(source), source)) != layers:
        raise UsageError(
            f"{what or f'--compare {entry}'}: {other} layers, but {root} has {layers}",
            hint="compare checkpoints of the same model",
        )
    heads = head_counts(config)
    scales = read_scale_set(source, layers, heads["k"], heads["q"])
    if target.neuron and is_per_head(scales.k, scales.v):
        raise UsageError(
            f"{source}: per-head KV scales, which {target.name} cannot serve: {NEURON_PER_HEAD_REASON}",
            hint="evaluate per-head scales with --target gpu; calibrate per tensor for Neuron",
        )
    return scales
