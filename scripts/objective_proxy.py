#!/usr/bin/env python3
"""Cheaper proxies for the scale objective, measured against it: do they pick the same scales?

The objective (kvcalib/calibration/objective.py) scores every candidate scale by the squared error of
the attention output on 16 sampled query rows per sequence. Two cheaper ways to choose:

- **fewer rows**: 4 query rows per sequence instead of 16 (rows 0, 1, 8, 9 of the 16, so the
  choosing / held-out halves alternate as before): a quarter of the matmuls;
- **probability KL** (K only): KL(p || p̂) of the attention probabilities, no product with V (V's
  error acts through the unchanged probabilities, so there is no KL for it).

Per layer and kind, each proxy's pick (by the same pick rule) against the objective's, and where they
differ, the objective's own held-out error of both picks (a different pick that is as good is no
miss). Also the seconds each took.

    python scripts/objective_proxy.py MODEL --dataset DATA [--target trn2] [--num-samples 16]
            [--max-seq-len 256] [--bf16-compute float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvcalib.calibration import objective  # noqa: E402
from kvcalib.calibration.native import observe_all  # noqa: E402
from kvcalib.core import fp8  # noqa: E402
from kvcalib.core.progress import no_progress  # noqa: E402
from kvcalib.hf.attention import KVAbsmaxObserver  # noqa: E402
from kvcalib.hf.compute import compute_path  # noqa: E402
from kvcalib.hf.data import load_calibration_data  # noqa: E402
from kvcalib.hf.model import faithful_attention, load_model, load_tokenizer, num_layers, pad_id  # noqa: E402
from kvcalib.hf.samples import AttentionSampler, attention_rows, sample_sequences  # noqa: E402


def fewer_rows(sample, keep: int = 4):
    """The sample with rows 0, 1, 8, 9 (of 16): choosing and held-out rows still alternate."""
    rows = sample.query.shape[1]
    index = (
        [j for j in range(rows) if (j // 2) % (rows // keep) == 0][:keep]
        if rows > keep
        else list(range(rows))
    )
    t = torch.tensor(index)
    return dataclasses.replace(
        sample,
        query=sample.query.index_select(1, t),
        bias=sample.bias.index_select(0, t),
        held_out=sample.held_out.index_select(0, t),
    )


def kl_terms(sample, k: objective.Candidates, target: fp8.Target) -> torch.Tensor:
    """[2, C]: KL(p || p̂) of the attention probabilities with K quantised, on the choosing and held-out rows."""
    _, p = attention_rows(sample)  # [Hkv, G*rows, L]
    quantised = fp8.fake_quantize(sample.key[None], k.scales[:, :, None, None], target)
    _, q = attention_rows(sample, key=quantised)  # [C, Hkv, G*rows, L]
    logp = p.clamp_min(1e-30).log()
    kl = (p * (logp - q.clamp_min(1e-30).log())).sum(-1).double()  # [C, Hkv, G*rows]
    held = sample.held_out.repeat(p.shape[1] // sample.query.shape[1])
    return torch.stack([kl[..., ~held].sum(dim=(-1, -2)), kl[..., held].sum(dim=(-1, -2))])


def pick(errors: list[float], held: list[float], keeps: list[bool]) -> int:
    return objective._pick(errors, held, keeps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--target", default="trn2")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--bf16-compute", default="float32", choices=["native", "float32"])
    args = parser.parse_args()
    print(provenance(), flush=True)
    target = fp8.get_target(args.target)
    tokenizer = load_tokenizer(args.model, False)
    data = load_calibration_data(
        args.dataset, tokenizer, num_samples=args.num_samples, max_seq_len=args.max_seq_len
    )
    from kvcalib.core.checkpoint import read_config
    from kvcalib.core.cpu import ComputePath

    config = read_config(args.model)
    model = load_model(
        args.model, None, torch.device("cpu"), False, attn_implementation=faithful_attention(config)
    )
    layers = num_layers(model)
    observer = KVAbsmaxObserver(
        layers,
        sampler=AttentionSampler(
            layers, sample_sequences(data.sequences, 4, pad_id(tokenizer), budget=10**9)
        ),
    )
    compute = ComputePath(
        "float32" if args.bf16_compute == "float32" else "native", "objective_proxy"
    )
    with compute_path(compute):
        observe_all(model, observer, data, 4, pad_id(tokenizer), torch.device("cpu"), no_progress)
    samples = observer.sampler.samples
    seconds = {"objective (16 rows)": 0.0, "4 rows": 0.0, "K probability KL": 0.0}
    same = {name: [0, 0] for name in seconds}  # [same pick, layers x kinds]
    misses = []
    for i in range(layers):
        kv_heads = samples[i][0].key.shape[0]
        grids = [
            objective.candidates(h, target, False, kv_heads)
            for h in (observer.k_heads[i], observer.v_heads[i])
        ]
        for name, rows in (
            ("objective (16 rows)", samples[i]),
            ("4 rows", [fewer_rows(s) for s in samples[i]]),
        ):
            started = time.perf_counter()
            terms = objective.sum_terms(
                [objective.sample_terms(s, [grids], [target])[0][0] for s in rows]
            )
            seconds[name] += time.perf_counter() - started
            picks = [
                pick(
                    [math.fsum(r) for r in terms[kind, 0].tolist()],
                    [math.fsum(r) for r in terms[kind, 1].tolist()],
                    grids[kind].keeps_range.all(dim=1).tolist(),
                )
                for kind in (0, 1)
            ]
            if name.startswith("objective"):
                full, full_terms = picks, terms
            for kind in (0, 1):
                same[name][0] += picks[kind] == full[kind]
                same[name][1] += 1
                if picks[kind] != full[kind]:
                    misses.append(
                        (
                            name,
                            i,
                            "KV"[kind],
                            grids[kind].labels[full[kind]],
                            grids[kind].labels[picks[kind]],
                            full_terms,
                            kind,
                            picks[kind],
                            full[kind],
                        )
                    )
        started = time.perf_counter()
        kl = objective.sum_terms([kl_terms(s, grids[0], target) for s in samples[i]])
        seconds["K probability KL"] += time.perf_counter() - started
        k_pick = pick(kl[0].tolist(), kl[1].tolist(), grids[0].keeps_range.all(dim=1).tolist())
        same["K probability KL"][0] += k_pick == full[0]
        same["K probability KL"][1] += 1
        if k_pick != full[0]:
            misses.append(
                (
                    "K probability KL",
                    i,
                    "K",
                    grids[0].labels[full[0]],
                    grids[0].labels[k_pick],
                    full_terms,
                    0,
                    k_pick,
                    full[0],
                )
            )
    tokens = sum(len(s) for s in data.sequences)
    print(
        f"{args.model.name}, {args.target}, {len(data.sequences)} x {args.max_seq_len} ({tokens} tokens), "
        f"{layers} layers"
    )
    print("| chooser | same pick as the objective | seconds |\n|---|---:|---:|")
    for name, (hits, total) in same.items():
        print(f"| {name} | {hits}/{total} | {seconds[name]:.1f} |")
    for name, layer, kind, theirs, mine, terms, k, c_mine, c_full in misses:
        held = terms[k, 1].sum(dim=-1)
        print(
            f"- {name}: layer {layer} {kind}: {mine} for {theirs}; the objective's held-out error "
            f"{math.sqrt(held[c_mine] / held[c_full]):.3f}x of its own pick's"
        )


if __name__ == "__main__":
    main()
