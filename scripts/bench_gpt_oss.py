#!/usr/bin/env python3
"""GPT-OSS-120B at scale, measured on a slice: stream-calibrating the released MXFP4 form, against a bare forward.

The slice has GPT-OSS-120B's real dimensions (hidden 2880, 128 experts, top-4, 64 query heads of 64, 8 KV
heads, expert width 2880, the released vocabulary of 201,088, YaRN rotary, sliding window 128 on even layers)
and --layers decoder layers (default 2) of random weights (normal, std 0.02), the experts MXFP4-quantised by the
tests' own quantiser (tests/support/mxfp4.py) and stored as released: one shard per layer plus one for the
embedding, norm and LM head, `quantization_config` {"quant_method": "mxfp4"}. A word-level tokenizer (Debian's
fortunes) stands in for the released one; only the embedding's size matters here.

Two fresh processes, each timed from outside (wall, CPU, peak RSS from wait4) and from inside:
  (a) calibrate  `kvcalib.calibrate(SLICE, ..., engine="stream", target="trn2")`: each layer's experts
                 dequantised in memory as it loads (kvcalib.core.mxfp4.dequantize), the hidden states carried on.
                 Per layer: seconds from its load to its last batch (the progress events), tokens/s.
                 Disk: /proc/self/io (read_bytes: from the device, 0 when the page cache holds the files; rchar /
                 wchar: through read/write calls) and the bytes of tensors the run must read.
  (c) forward    the floor: the same checkpoint loaded by transformers (`from_pretrained` with
                 Mxfp4Config(dequantize=True), its dequantisation run a few experts at a time as kvcalib runs it:
                 every layer in memory, which is why the slice is small), the decoder
                 (no LM head) run over the same right-padded batches under the same compute path
                 (kvcalib.hf.compute: bf16 matmuls in float32 on CPUs without native bf16), inference mode, no
                 cache, nothing recorded. Load and forward timed apart.
Targets (the issue's): peak RSS of (a) <= one layer's dequantised weights + the hidden states + 2 GiB;
(a)'s observing tokens/s within 1.2x of (c)'s forward tokens/s.

The prediction for the whole model (36 layers, 512 samples x 2048 tokens): per layer, (a)'s load time (read +
dequantise; independent of the tokens) plus its compute time scaled by tokens and by the analytic FLOPs per
token at 2048 against the measured length (attention grows with context, the rest does not). On a 192-vCPU host
(96 physical cores) the assumption is stated with the numbers: compute scales with the physical cores used at
the efficiency given by --efficiency (default 0.5), the load is not scaled (transformers' dequantisation
did not scale with threads; kvcalib's table does, partly: scripts/bench_mxfp4_load.py). RSS: (a)'s peak
without the hidden states, plus the hidden states of 512 x 2048 tokens unless they spill
(kvcalib.calibration.stream spills them to disk when they would take more than half the memory left).
Disk: the released files read once; the output is links plus ~20 kB; a spill writes and reads the hidden
states once per layer.

    python scripts/bench_gpt_oss.py [--layers 2] [--num-samples 16] [--max-seq-len 256] [--threads 2]
        [--work DIR (kept: the slice is reused when it is there)] [--skip-forward]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance  # this folder is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30
SHAPE = dict(
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=128,
    num_experts_per_tok=4,
    vocab_size=201088,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
FULL_LAYERS, FULL_SAMPLES, FULL_SEQ = 36, 512, 2048


def flops_per_token(seq: int) -> float:
    """Forward FLOPs per token per layer at sequence length `seq` (causal: a token sees (seq + 1) / 2 on average;
    the sliding window of even layers ignored, which overstates them)."""
    h, heads, kv, d, inter, k = (
        SHAPE[n]
        for n in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_experts_per_tok",
        )
    )
    projections = 2 * h * (heads * d + 2 * kv * d) + 2 * heads * d * h
    attention = 2 * 2 * heads * d * (seq + 1) / 2
    experts = k * 2 * (h * 2 * inter + inter * h) + 2 * h * SHAPE["num_local_experts"]
    return projections + attention + experts


def child_env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(
            p
            for p in (str(REPO), str(REPO / "tests" / "support"), os.environ.get("PYTHONPATH"))
            if p
        ),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TQDM_DISABLE": "1",
    }


# --- the slice ------------------------------------------------------------------------------------------------


def build_slice(out: Path, layers: int, threads: int) -> None:
    """The GPT-OSS-120B-shaped slice, as released (MXFP4 experts), written one layer's shard at a time."""
    import torch
    from helpers import build_word_tokenizer
    from mxfp4 import MXFP4_QUANTIZATION_CONFIG, quantize_mxfp4
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.set_num_threads(threads)
    tokenizer = build_word_tokenizer()
    config = GptOssConfig(
        **SHAPE,
        num_hidden_layers=layers,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GptOssForCausalLM(config).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map, shards = (
        {},
        [(f"model.layers.{i}.", f"model-layer-{i:02d}.safetensors") for i in range(layers)],
    )
    shards.append(("", "model-rest.safetensors"))
    for prefix, name in shards:
        started, state = time.perf_counter(), {}
        keys = (
            [k for k in shapes if k.startswith(prefix)]
            if prefix
            else [k for k in shapes if not k.startswith("model.layers.")]
        )
        for key in keys:
            shape = shapes[key]
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                parts = [
                    quantize_mxfp4(
                        (torch.randn((8, *shape[1:]), generator=generator) * 0.02).to(
                            torch.bfloat16
                        )
                    )
                    for _ in range(0, shape[0], 8)
                ]
                state[f"{key}_blocks"] = torch.cat([b for b, _ in parts])
                state[f"{key}_scales"] = torch.cat([s for _, s in parts])
            elif key.endswith("norm.weight"):
                state[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                state[key] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        save_file(state, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, name))
        print(
            f"  wrote {name}: {sum(t.nbytes for t in state.values()) / GiB:.2f} GiB in "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
    total = sum((out / n).stat().st_size for _, n in shards)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    config.save_pretrained(out)
    on_disk = json.loads((out / "config.json").read_text())
    on_disk["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(on_disk, indent=2))
    tokenizer.save_pretrained(out)


# --- the children ---------------------------------------------------------------------------------------------


def proc_io() -> dict[str, int]:
    return {
        k: int(v)
        for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    }


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB, the VmHWM


def child_calibrate(args: argparse.Namespace) -> None:
    import kvcalib

    marks: dict[int, list[float]] = {}
    started = time.perf_counter()

    def progress(p) -> None:
        if p.stage == "observe":
            marks.setdefault(p.layer, []).append(time.perf_counter() - started)

    result = kvcalib.calibrate(
        args.model,
        args.dataset,
        args.out,
        target="trn2",
        engine="stream",
        num_samples=args.num_samples,
        max_seq_len=args.max_seq_len,
        batch_size=args.batch_size,
        progress=progress,
    )
    print(
        json.dumps(
            {
                "wall": time.perf_counter() - started,
                "observe_s": result.observe_seconds,
                "objective_s": result.objective_seconds,
                "tokens": result.num_tokens,
                "layers": [marks[k] for k in sorted(marks)],
                "io": proc_io(),
                "peak_rss": peak_rss(),
                "compute": result.compute,
            }
        )
    )


def child_forward(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    # internal: the bare forward loads, batches and computes as calibrate does, so only the observing differs
    from kvcalib.core.cpu import HostCpu, choose_compute
    from kvcalib.core.mxfp4 import expert_chunks
    from kvcalib.hf.compute import compute_path
    from kvcalib.hf.data import batches, load_calibration_data

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_calibration_data(
        args.dataset, tokenizer, num_samples=args.num_samples, max_seq_len=args.max_seq_len
    )
    started = time.perf_counter()
    with (
        expert_chunks()
    ):  # transformers' dequantisation, a few experts at a time (as kvcalib loads)
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
        ).eval()
    loaded = time.perf_counter()
    path = choose_compute("auto", torch.bfloat16, torch.device("cpu"), HostCpu.detect())
    tokens = 0
    with torch.inference_mode(), compute_path(path):
        for ids, mask in batches(data.sequences, args.batch_size, tokenizer.pad_token_id):
            model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            tokens += int(mask.sum())
    done = time.perf_counter()
    print(
        json.dumps(
            {
                "load_s": loaded - started,
                "forward_s": done - loaded,
                "tokens": tokens,
                "tokens_per_s": tokens / (done - loaded),
                "peak_rss": peak_rss(),
                "compute": path.describe(),
            }
        )
    )


# --- the parent -----------------------------------------------------------------------------------------------


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, dict]:
    """(wall s, CPU s, peak RSS bytes, the child's JSON) of one child process; exits on failure."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{' '.join(cmd[:6])} ... failed:\n{err.read()[-4000:]}")
        return (
            wall,
            usage.ru_utime + usage.ru_stime,
            usage.ru_maxrss * 1024,
            json.loads(out.read().splitlines()[-1]),
        )


def layer_bytes(model: Path) -> tuple[int, int, int]:
    """(one layer's dequantised bf16 bytes, its bytes on disk, the non-layer bytes on disk)."""
    h, inter, e = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_local_experts"]
    experts = e * (h * 2 * inter + inter * h)
    dense = h * (
        SHAPE["num_attention_heads"] * SHAPE["head_dim"] * 2
        + 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    )
    on_disk = (model / "model-layer-00.safetensors").stat().st_size
    return 2 * (experts + dense), on_disk, (model / "model-rest.safetensors").stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--efficiency", type=float, default=0.5, help="the 192-vCPU prediction's scaling efficiency"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="kept; a slice already there is reused"
    )
    parser.add_argument(
        "--skip-forward", action="store_true", help="leave out (c): it holds every layer in memory"
    )
    parser.add_argument(
        "--smoke", action="store_true", help=argparse.SUPPRESS
    )  # tiny dimensions: checks the script
    parser.add_argument("--child", choices=["calibrate", "forward"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        SHAPE.update(
            hidden_size=64,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            vocab_size=4096,
        )
    if args.child:
        (child_calibrate if args.child == "calibrate" else child_forward)(args)
        return

    print(provenance(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvcalib-gpt-oss-"))
    model, dataset = work / f"gpt-oss-120b-slice-{args.layers}", work / "fortunes.jsonl"
    if not (model / "config.json").exists():
        print(f"building the slice ({args.layers} layers) in {model} ...", flush=True)
        sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO)]
        build_slice(model, args.layers, args.threads)
    if not dataset.exists():
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "make_text_dataset.py"), str(dataset)],
            check=True,
            capture_output=True,
        )
    env = child_env(args.threads)
    child = [
        sys.executable,
        str(Path(__file__).resolve()),
        *(["--smoke"] if args.smoke else []),
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--num-samples",
        str(args.num_samples),
        "--max-seq-len",
        str(args.max_seq_len),
        "--batch-size",
        str(args.batch_size),
        "--child",
    ]
    out = work / "calibrated"
    shutil.rmtree(out, ignore_errors=True)
    a_wall, a_cpu, a_rss, a = run_measured([*child, "calibrate", "--out", str(out)], env)
    written = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.stat().st_nlink == 1)
    c = None
    if not args.skip_forward:
        c_wall, c_cpu, c_rss, c = run_measured([*child, "forward"], env)
    report(
        args, model, (a_wall, a_cpu, a_rss, a), written, (c_wall, c_cpu, c_rss, c) if c else None
    )
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def report(args, model: Path, a_run, written: int, c_run) -> None:
    a_wall, a_cpu, a_rss, a = a_run
    layer_bf16, layer_disk, rest_disk = layer_bytes(model)
    hidden = a["tokens"] * SHAPE["hidden_size"] * 2
    tokens = a["tokens"]
    print(
        f"\nGPT-OSS-120B slice: {args.layers} layers, {tokens:,} tokens ({args.num_samples} x <= {args.max_seq_len}),"
        f" batch {args.batch_size}, {args.threads} threads; {a['compute']}"
    )
    print(
        f"one layer: {layer_bf16 / GiB:.2f} GiB dequantised bf16, {layer_disk / GiB:.2f} GiB MXFP4 on disk; "
        f"embedding + LM head + norm {rest_disk / GiB:.2f} GiB"
    )
    # each layer's batches: [done at t1, ..., tB]; compute = (tB - t1) * B / (B - 1); load = the gap before it
    loads, computes, previous = [], [], None
    for i, marks in enumerate(a["layers"]):
        n = len(marks)
        compute = (marks[-1] - marks[0]) * n / (n - 1) if n > 1 else float("nan")
        load = marks[-1] - previous - compute if previous is not None else None
        computes.append(compute)
        if load is not None:
            loads.append(load)
        last = " (the last layer: it stops after its K/V)" if i == len(a["layers"]) - 1 else ""
        print(
            f"  (a) layer {i}: compute {compute:.1f} s ({tokens / compute:,.0f} tok/s){last}"
            + (
                f", load {load:.1f} s (read + dequantise)"
                if load is not None
                else ", load with the embedding's"
            )
        )
        previous = marks[-1]
    a_compute = sum(computes)
    full = computes[:-1] or computes  # layers run whole (every layer but the last)
    per_layer = sum(full) / len(full)
    print(
        f"(a) stream calibrate: {a_wall:.1f} s wall, {a_cpu:.1f} s CPU; observing {a['observe_s']:.1f} s (loads "
        f"included), compute {a_compute:.1f} s ({tokens * args.layers / a_compute:,.0f} token-layers/s), scale "
        f"objective {a['objective_s']:.1f} s; peak RSS {a_rss / GiB:.2f} GiB"
    )
    io = a["io"]
    print(
        f"    disk: read_bytes {io['read_bytes'] / GiB:.2f} GiB (0 where the page cache held the files), rchar "
        f"{io['rchar'] / GiB:.2f} GiB; wchar {io['wchar'] / 2**20:.1f} MiB; output {written / 1e3:.0f} kB written "
        f"(the weights are links); tensors to read {(args.layers * layer_disk + rest_disk) / GiB:.2f} GiB"
    )
    bound = layer_bf16 + hidden + 2 * GiB
    print(
        f"    target peak RSS <= one layer + hidden states + 2 GiB = {bound / GiB:.2f} GiB: "
        f"{'met' if a_rss <= bound else 'NOT met'} ({a_rss / bound:.2f} of it)"
    )
    if c_run:
        c_wall, c_cpu, c_rss, c = c_run
        print(
            f"(c) bare forward: {c_wall:.1f} s wall, {c_cpu:.1f} s CPU; load {c['load_s']:.1f} s, forward "
            f"{c['forward_s']:.1f} s ({tokens * args.layers / c['forward_s']:,.0f} token-layers/s); peak RSS "
            f"{c_rss / GiB:.2f} GiB"
        )
        print(
            f"    one whole layer's compute a/c = {per_layer / (c['forward_s'] / args.layers):.2f} (target <= 1.2)"
            f"   load a/c = "
            f"{(a['observe_s'] - a_compute) / c['load_s']:.2f}   wall a/c = "
            f"{a_wall / c_wall:.2f}   peak RSS a/c = {a_rss / c_rss:.2f}"
        )
    # the whole model
    load_s = sum(loads) / len(loads) if loads else (a["observe_s"] - a_compute) / args.layers
    per_token = per_layer / tokens
    scale = flops_per_token(FULL_SEQ) / flops_per_token(args.max_seq_len)
    full_tokens = FULL_SAMPLES * FULL_SEQ
    compute_here = FULL_LAYERS * full_tokens * per_token * scale
    here = FULL_LAYERS * load_s + compute_here
    big = FULL_LAYERS * load_s + compute_here * args.threads / (96 * args.efficiency)
    full_hidden = full_tokens * SHAPE["hidden_size"] * 2
    print(
        f"\nwhole GPT-OSS-120B (36 layers, {FULL_SAMPLES} x {FULL_SEQ} = {full_tokens:,} tokens), predicted:"
    )
    print(
        f"  per layer (36 taken whole; the last stops after its K/V): load {load_s:.1f} s (not scaled), compute "
        f"{per_token * 1e3:.3f} ms/token at "
        f"{args.max_seq_len} tokens x {scale:.2f} (FLOPs at {FULL_SEQ})"
    )
    print(
        f"  this machine ({args.threads} threads): {here / 3600:.1f} h; a 192-vCPU host (96 cores at "
        f"{args.efficiency:.0%} of linear, load not scaled): {big / 3600:.2f} h"
    )
    print(
        f"  peak RSS: {(a_rss - hidden) / GiB:.1f} GiB + hidden states {full_hidden / GiB:.1f} GiB (spilled to disk "
        "where that is over half the free memory)"
    )
    print(
        f"  disk read {(FULL_LAYERS * layer_disk + rest_disk) / GiB:.0f} GiB (the released files once); written "
        f"~{written / 1e3:.0f} kB + links, and with a spill {FULL_LAYERS * full_hidden / GiB:.0f} GiB of hidden "
        "states written and read back (once a layer)"
    )


if __name__ == "__main__":
    main()
