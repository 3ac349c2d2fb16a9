"""eval: predict FP8-KV accuracy on CPU (or GPU) with the target chip's own numerics.

Each batch of held-out text runs once with an unquantised KV cache (the baseline) and once per scale configuration
with K/V quantised as the chip stores them (fp8.fake_quantize through kvcalib.hf.attention's hook), teacher-forced in
the server's order (--order, fp8.Target.order): GPU, every position reads the FP8 cache; Neuron, a row's first half
is a prefill on fresh K/V, the decode steps that follow (alone scored) read FP8 (emulate.FreshPrefill). Against the
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
from kvcalib.core.checkpoint import read_config, scan_checkpoint
from kvcalib.core.choice import ScaleChoice
from kvcalib.core.cpu import ComputePath
from kvcalib.core.errors import UsageError
from kvcalib.core.progress import Progress, ProgressCallback, no_progress
from kvcalib.core.schema import NEURON_PER_HEAD_REASON, head_counts, num_hidden_layers
from kvcalib.evaluation.emulate import (
    FreshPrefill,
    KVErrorMeter,
    KVQuantizer,
    LayerQuantStats,
    is_per_head,
)
from kvcalib.evaluation.layers import layers_alone
from kvcalib.evaluation.options import EvalOptions
from kvcalib.evaluation.scales import ScaleSet, read_scale_set
from kvcalib.evaluation.scoring import log_probs, row_sums, scored_tokens, token_kl
from kvcalib.evaluation.significance import Interval, paired_bootstrap
from kvcalib.hf.compute import Float32Weights
from kvcalib.hf.data import CalibrationData, batches, load_calibration_data
from kvcalib.hf.model import (
    PreparedRun,
    faithful_attention,
    load_model,
    load_tokenizer,
    num_layers,
    pad_id,
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
    "RunResult",
    "evaluate",
    "prepare_scales",
]

UNIT = "unit"  # --compare unit: every scale 1.0 (what a checkpoint without scales runs with)
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class RunResult:
    """One scale set in EvalResult's runs: name ("checkpoint", "unit" or a --compare path), kind; per scored token
    against the unquantised run: nll, ppl, delta_nll, kl (nats), top1 (agreement with its top-1), accuracy (fractions);
    delta_nll_interval, delta_accuracy_interval (Interval; null: < 2 rows); layers (LayerQuantStats)."""

    name: str
    nll: float
    ppl: float
    delta_nll: float
    kl: float
    top1: float
    layers: tuple[LayerQuantStats, ...]
    kind: str = (
        ""  # "KV per-tensor", "KV per-head", "FP8 attn, per-tensor" (Q too), "FP8 attn, per-head"
    )
    accuracy: float = (
        0.0  # next-token top-1 accuracy (top1 is the agreement with the unquantised run's top-1)
    )
    intervals: tuple[Interval | None, Interval | None] = (
        None,
        None,
    )  # paired: ΔNLL, Δ accuracy (None: < 2 rows)
    # every scored token's NLL, row after row (float64; not in to_dict): serve-check pairs them with the server's
    token_nll: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def delta_nll_interval(self) -> Interval | None:
        return self.intervals[0]

    @property
    def k_clipped(self) -> float:
        return sum(s.k.clipped for s in self.layers) / max(len(self.layers), 1)

    @property
    def v_clipped(self) -> float:
        return sum(s.v.clipped for s in self.layers) / max(len(self.layers), 1)

    def to_dict(self) -> dict[str, Any]:
        nll, accuracy = self.intervals
        return {
            "name": self.name,
            "kind": self.kind,
            "nll": self.nll,
            "ppl": self.ppl,
            "delta_nll": self.delta_nll,
            "kl": self.kl,
            "top1": self.top1,
            "accuracy": self.accuracy,
            "delta_nll_interval": None if nll is None else nll.to_dict(),
            "delta_accuracy_interval": None if accuracy is None else accuracy.to_dict(),
            "layers": [s.to_dict() for s in self.layers],
        }


@dataclass(frozen=True)
class EvalResult:
    """What `eval --dataset` measured; to_dict() is its --json: checkpoint, target, fp8_max, order (neuron: only the
    decode steps after a fresh-K/V prefill of each row's first half are scored; gpu: every position reads FP8), compute,
    num_samples, num_tokens, baseline (the unquantised run's nll, ppl, accuracy), runs (RunResult), seconds, plot,
    layer_rows."""

    checkpoint: str
    target: str
    fp8_max: float
    num_samples: int
    num_tokens: int  # next-token predictions scored
    baseline_nll: float
    runs: tuple[RunResult, ...]
    baseline_accuracy: float = 0.0  # next-token top-1 accuracy of the unquantised run
    seconds: float = 0.0
    plot: str | None = None
    compute: str = ""
    layer_rows: int = 0  # rows the per-layer ΔNLL (LayerQuantStats.delta_nll_alone) was measured on
    baseline_token_nll: torch.Tensor | None = field(
        default=None, compare=False, repr=False
    )  # as RunResult's
    order: str = fp8.GPU_ORDER

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "target": self.target,
            "fp8_max": self.fp8_max,
            "order": self.order,
            "compute": self.compute,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "baseline": {
                "nll": self.baseline_nll,
                "ppl": math.exp(self.baseline_nll),
                "accuracy": self.baseline_accuracy,
            },
            "runs": [r.to_dict() for r in self.runs],
            "seconds": round(self.seconds, 3),
            "plot": self.plot,
            "layer_rows": self.layer_rows,
        }


@dataclass
class _Totals:
    """Running sums over scored tokens for one configuration, and per sequence (for the paired intervals)."""

    nll: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    count: int = 0
    quantizer: KVQuantizer | None = None
    row_nll: list[float] = field(
        default_factory=list
    )  # per sequence: Σ NLL, correct top-1 predictions, tokens
    row_correct: list[float] = field(default_factory=list)
    row_tokens: list[int] = field(default_factory=list)
    token_nll: list[torch.Tensor] = field(
        default_factory=list
    )  # per row: its scored tokens' NLLs (float64)

    def add(self, logp: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """One batch's next-token log-probabilities [B, S-1, V] against `targets` [B, S-1]; returns the top-1."""
        token_nll, top1 = -logp.gather(-1, targets[..., None])[..., 0], logp.argmax(-1)
        nll = row_sums(token_nll, scored)
        self.nll += float(nll.sum())
        self.count += int(scored.sum())
        self.row_nll += nll.tolist()
        self.row_correct += row_sums(top1 == targets, scored).tolist()
        self.row_tokens += scored.sum(dim=1).tolist()
        values, masks = token_nll.double().cpu(), scored.cpu()  # one transfer a batch
        self.token_nll += [row[mask] for row, mask in zip(values, masks)]
        return top1

    def tokens(self) -> torch.Tensor:
        return torch.cat(self.token_nll) if self.token_nll else torch.zeros(0, dtype=torch.float64)


def _intervals(run: _Totals, baseline: _Totals) -> tuple[Interval | None, Interval | None]:
    """Paired intervals over sequences: ΔNLL per token, and the change in top-1 accuracy (next token)."""
    nll = paired_bootstrap(
        [q - b for q, b in zip(run.row_nll, baseline.row_nll)], baseline.row_tokens
    )
    top1 = paired_bootstrap(
        [q - b for q, b in zip(run.row_correct, baseline.row_correct)],
        baseline.row_tokens,
        worse_if_higher=False,
    )
    return nll, top1


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
    run, quantizers, compute = prepare_scales(checkpoint, opts)
    ckpt, dtype, device = run.checkpoint, run.dtype, run.device
    target = quantizers[CHECKPOINT].target
    order = opts.order or target.order
    fresh = order == fp8.NEURON_ORDER
    layers = _config_num_layers(ckpt.config, ckpt.root)

    notify(Progress("load-data"))
    tokenizer = load_tokenizer(ckpt.root, opts.trust_remote_code)
    data = load_calibration_data(
        dataset,
        tokenizer,
        split=opts.split,
        text_column=opts.text_column,
        num_samples=opts.num_samples,
        max_seq_len=opts.max_seq_len,
        seed=opts.seed,
        add_special_tokens=opts.add_special_tokens,
    )
    if sum(len(s) // 2 - 1 if fresh else len(s) - 1 for s in data.sequences) < 1:
        raise UsageError(
            f"the evaluation samples are all {'under 4 tokens' if fresh else 'one token'} long: "
            f"nothing to score in the {order} order",
            hint="pass longer texts or a larger --max-seq-len"
            + (", or --order gpu" if fresh else ""),
        )
    notify(Progress("load-model"))
    model = load_model(
        ckpt,
        dtype,
        device,
        opts.trust_remote_code,
        attn_implementation=faithful_attention(ckpt.config),
    )
    if num_layers(model) != layers:
        raise UsageError(
            f"{ckpt.root}: config says {layers} layers, the model has {num_layers(model)}",
            hint="use the config.json and the weights of one and the same model",
        )

    totals = {name: _Totals(quantizer=quantizer) for name, quantizer in quantizers.items()}
    sampler = AttentionSampler(
        layers, sample_sequences(data.sequences, opts.batch_size, pad_id(tokenizer))
    )
    meter = KVErrorMeter({name: t.quantizer for name, t in totals.items()}, device, sampler)
    forward = functools.partial(log_probs, model, compute=compute, weights=Float32Weights())
    baseline = _score(
        forward, data, opts.batch_size, pad_id(tokenizer), device, meter, totals, notify, fresh
    )
    base_nll_mean = baseline.nll / baseline.count
    alone = layers_alone(
        forward,
        data.sequences[: opts.layer_rows],
        opts.batch_size,
        pad_id(tokenizer),
        device,
        quantizers,
        notify,
        fresh,
    )
    runs = tuple(
        RunResult(
            name=name,
            nll=t.nll / t.count,
            ppl=math.exp(t.nll / t.count),
            delta_nll=t.nll / t.count - base_nll_mean,
            kl=t.kl / t.count,
            top1=t.agree / t.count,
            layers=_chosen(meter.layer_stats(name, alone.get(name)), ckpt.root, name),
            kind=_kind(t.quantizer),
            accuracy=sum(t.row_correct) / t.count,
            intervals=_intervals(t, baseline),
            token_nll=t.tokens(),
        )
        for name, t in totals.items()
    )
    return EvalResult(
        checkpoint=str(checkpoint),
        target=target.name,
        fp8_max=target.fp8_max,
        order=order,
        num_samples=len(data.sequences),
        num_tokens=baseline.count,
        baseline_nll=base_nll_mean,
        baseline_accuracy=sum(baseline.row_correct) / baseline.count,
        runs=runs,
        seconds=time.perf_counter() - started,
        compute=compute.describe(),
        layer_rows=min(opts.layer_rows, len(data.sequences)),
        baseline_token_nll=baseline.tokens(),
    )


FP8_ATTN = " +fp8-attn"


def _chosen(stats: list[LayerQuantStats], root: Path, name: str) -> tuple[LayerQuantStats, ...]:
    """`stats` with what kvcalib's scale objective chose per layer, where the run's checkpoint provenance says."""
    base = name.removesuffix(FP8_ATTN)
    source = root if base == CHECKPOINT else None if base == UNIT else Path(base)
    provenance = (
        read_provenance(scan_checkpoint(source, tolerant=True))
        if source and source.is_dir()
        else None
    )
    chosen: dict[Any, dict[str, ScaleChoice]] = {}
    for entry in (provenance or {}).get("layers") or ():
        kinds = {
            kind: ScaleChoice(choice["label"])
            for kind in "kv"
            if isinstance(entry, dict)
            and isinstance(entry.get(kind), dict)
            and isinstance(choice := entry[kind].get("choice"), dict)
            and isinstance(choice.get("label"), str)
        }
        if kinds:
            chosen[entry.get("layer")] = kinds
    return tuple(replace(s, chosen=chosen[s.layer]) if s.layer in chosen else s for s in stats)


def prepare_scales(
    checkpoint: str | Path, opts: EvalOptions
) -> tuple[PreparedRun, dict[str, KVQuantizer], ComputePath]:
    """The checkpoint, a quantiser per scale set and the compute path: all eval checks before data or model."""
    opts.check_arguments()
    target = resolve_target(opts.target)
    run = prepare_run(checkpoint, opts)
    layers = _config_num_layers(run.checkpoint.config, run.checkpoint.root)
    configs: dict[str, ScaleSet] = {}
    for entry in (
        CHECKPOINT,
        *opts.compare,
    ):  # the checkpoint's own scales, then each --compare entry
        if entry in configs:
            raise UsageError(f"--compare {entry} given twice", hint="name each comparison once")
        configs[entry] = scale_set(
            entry, run.checkpoint.root, layers, target, run.checkpoint.config
        )
    quantizers = _quantizers(configs, target, opts.fp8_attention)
    return (
        run,
        quantizers,
        resolve_compute(opts.bf16_compute, run.dtype, run.checkpoint, run.device, opts.cpu),
    )


def _score(
    forward: Callable[..., torch.Tensor],
    data: CalibrationData,
    batch_size: int,
    pad: int,
    device: torch.device,
    meter: KVErrorMeter,
    totals: dict[str, _Totals],
    notify: ProgressCallback,
    fresh_prefill: bool,
) -> _Totals:
    """Every batch unquantised (the baseline, returned; `meter` rides along) and once per scale configuration."""
    baseline = _Totals()
    done_samples = done_tokens = 0
    notify(Progress("observe", 0, len(data.sequences), 0, data.num_tokens))
    for input_ids, mask in batches(data.sequences, batch_size, pad):
        input_ids, mask = input_ids.to(device), mask.to(device)
        scored = scored_tokens(mask, fresh_prefill)
        targets = input_ids[:, 1:]
        meter.token_mask = mask.bool()
        meter.sampler.start_batch(input_ids, mask)  # evaluate's meter always has one
        base_logp = forward(input_ids, mask, meter)
        meter.token_mask = None
        meter.sampler.end_batch()
        base_top1 = baseline.add(base_logp, targets, scored)
        for run in totals.values():
            logp = forward(
                input_ids,
                mask,
                FreshPrefill(run.quantizer, mask) if fresh_prefill else run.quantizer,
            )
            top1 = run.add(logp, targets, scored)
            kl = token_kl(base_logp, logp)
            run.kl += kl[scored].double().sum().item()
            run.agree += (top1 == base_top1)[scored].sum().item()
            del logp, kl
        done_samples += input_ids.shape[0]
        done_tokens += int(mask.sum())
        notify(Progress("observe", done_samples, len(data.sequences), done_tokens, data.num_tokens))
    return baseline


def _config_num_layers(config: dict[str, Any], where: Path) -> int:
    layers = num_hidden_layers(config)
    if layers is None:
        raise UsageError(
            f"{where}: config.json has no usable num_hidden_layers",
            hint=f"run `kvcalib validate {where}`",
        )
    return layers


def scale_set(
    entry: str,
    model_dir: Path,
    num_layers: int,
    target: fp8.Target,
    config: dict[str, Any],
    what: str | None = None,
) -> ScaleSet:
    """One configuration's scales: CHECKPOINT (model_dir's own), UNIT (every scale 1.0) or another checkpoint's
    path (of the same model: as many layers), per tensor or per head; per-head scales refused for Neuron.
    `what` names the entry in messages (default "--compare ENTRY")."""
    what = what or f"--compare {entry}"
    if entry == UNIT:
        scales = ScaleSet([1.0] * num_layers, [1.0] * num_layers, None)
    else:
        source = model_dir if entry == CHECKPOINT else Path(entry)
        if source != model_dir:
            other_layers = _config_num_layers(read_config(source), source)
            if other_layers != num_layers:
                raise UsageError(
                    f"{what}: {other_layers} layers, but {model_dir} has {num_layers}",
                    hint="compare checkpoints of the same model",
                )
        heads = head_counts(config)
        scales = read_scale_set(source, num_layers, heads["k"], heads["q"])
    if scales.per_head and target.neuron:
        raise UsageError(
            f"{model_dir if entry == CHECKPOINT else entry}: per-head KV scales, which {target.name} "
            f"cannot serve: {NEURON_PER_HEAD_REASON}",
            hint="evaluate per-head scales with --target gpu; calibrate per tensor for Neuron",
        )
    return scales


def _kind(quantizer: KVQuantizer) -> str:
    heads = "per-head" if is_per_head(quantizer.k_scales, quantizer.v_scales) else "per-tensor"
    return f"FP8 attn, {heads}" if quantizer.fp8_attention else f"KV {heads}"


def _quantizers(
    configs: dict[str, ScaleSet], target: fp8.Target, fp8_attention: bool
) -> dict[str, KVQuantizer]:
    """One run per configuration (K/V in FP8); with --fp8-attention one more for each that has q_scale."""
    runs = {name: KVQuantizer(s.k, s.v, target) for name, s in configs.items()}
    if fp8_attention:
        with_q = {name: s for name, s in configs.items() if s.q is not None}
        if not with_q:
            raise UsageError(
                "--fp8-attention needs q_scale, and no checkpoint evaluated has one",
                hint="calibrate with kvcalib calibrate --attention-scales",
            )
        for name, s in with_q.items():
            runs[name + FP8_ATTN] = KVQuantizer(s.k, s.v, target, q_scales=s.q, fp8_attention=True)
    return runs
