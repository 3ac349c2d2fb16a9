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
                 dequantised in memory as it loads (kvcalib.hf.mxfp4.dequantize), the hidden states carried on.
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

With --ranks R > 1, (a) runs under torchrun (`python -m torch.distributed.run --standalone --nproc-per-node R`),
each rank with --threads threads: kvcalib.calibrate shares whole batches between the ranks
(kvcalib.calibration.distributed), so the samples must make R batches at least. Rank 0 prints the JSON (its
progress marks, its /proc/self/io); wall and CPU are the whole torchrun tree's, and the peak RSS from wait4 is
the largest single process of the tree (Linux's maxrss of a reaped child takes the largest of its own reaped
children, RUSAGE_CHILDREN's), not the ranks' sum. (a) also reports the scale objective's search
(objective_seconds).

The prediction for the whole model is built from the parts measured, for kvcalib's own defaults (samples and
sequence length read from CalibrateOptions; 36 layers) and the whole run, not only the observation:
  load     a layer's read + dequantise (the gap before a layer's batches), x 36. Not scaled with cores: the
           read is the disk's; the dequantisation scales only partly (scripts/BENCHMARKS.md, "One layer's load").
  observe  the measured compute per token per layer (all ranks together), scaled by the analytic FLOPs per
           token at the default length against the measured one (attention grows with context, the rest does
           not), x the default tokens x 36.
  search   the scale objective's search per layer, x 36, x the K/V tokens it samples at the defaults over those
           it sampled here (kvcalib.hf.samples.sample_sequences: whole batches until SAMPLE_TOKENS, whatever the
           budget: one batch of 4 x 2048 at the defaults, 2 of 4 x 256 at the script's).
  write    the output: links to the released weights plus a few kB of files (measured here), no time to speak of.
A total each for this machine (the measured ranks x threads) and for a 192-vCPU host, where the observe and search
compute are divided by a speed-up S, --speedup, by default 96 physical cores / (ranks x threads) x --efficiency
(0.5): the compute assumed to scale with the cores at that share of linear; the load is not scaled. The formula
and its numbers are printed with the prediction. RSS (one process): (a)'s peak without its hidden states, plus its
share of the default tokens' hidden states unless they spill (kvcalib.calibration.stream spills them to disk when
they would take more than half the memory left). Disk: the released files read once; the output is links plus
~20 kB; a spill writes and reads the hidden states once per layer.

    python scripts/bench_gpt_oss.py [--layers 2] [--num-samples 16] [--max-seq-len 256] [--threads 2] [--ranks 1]
        [--efficiency 0.5 | --speedup S]
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
FULL_LAYERS = 36


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


def sampled_tokens(batch_size: int, seq: int) -> int:
    """The K/V tokens the search samples a layer with rows of `seq` tokens: whole batches until SAMPLE_TOKENS."""
    from kvcalib.hf.samples import SAMPLE_TOKENS

    batch = batch_size * seq
    return -(-SAMPLE_TOKENS // batch) * batch


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
    if os.environ.get("RANK", "0") != "0":  # under torchrun: rank 0 reports
        return
    print(
        json.dumps(
            {
                "wall": time.perf_counter() - started,
                "observe_s": result.observe_seconds,
                "objective_s": result.objective_seconds,
                "world": int(os.environ.get("WORLD_SIZE", "1")),
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
    from kvcalib.calibration.options import CalibrateOptions
    from kvcalib.core.cpu import HostCpu, choose_compute
    from kvcalib.hf.compute import compute_path
    from kvcalib.hf.data import batches, load_calibration_data
    from kvcalib.hf.mxfp4 import expert_chunks

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    opts = CalibrateOptions(num_samples=args.num_samples, max_seq_len=args.max_seq_len)
    data = load_calibration_data(args.dataset, tokenizer, opts)
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
    """(wall s, CPU s, peak RSS bytes, the child's JSON: its last line that starts with "{") of one child process;
    exits on failure. Under torchrun the child is torchrun's launcher: wait4's rusage then counts the CPU of the
    whole tree and its maxrss is the largest of the launcher and its (waited-for) ranks (Linux keeps the children's
    largest, RUSAGE_CHILDREN's maxrss), i.e. the largest one process, not their sum."""
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
            json.loads([line for line in out.read().splitlines() if line.startswith("{")][-1]),
        )


def full_run() -> dict:
    """kvcalib's own defaults (CalibrateOptions' fields)."""
    import dataclasses

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from kvcalib.calibration.options import CalibrateOptions

    return {f.name: f.default for f in dataclasses.fields(CalibrateOptions)}


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
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each process")
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="(a) under torchrun with this many processes (1: one plain process)",
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        default=0.5,
        help="the 192-vCPU prediction's scaling efficiency (of linear in the cores)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=None,
        help="the 192-vCPU host's compute over this machine's "
        "(default: 96 / (ranks x threads) x --efficiency)",
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

    if (
        -(-args.num_samples // args.batch_size) < 2 * args.ranks
    ):  # kvcalib shares whole batches between ranks; a layer's compute needs 2 on rank 0
        parser.error(
            f"--ranks {args.ranks} needs {2 * args.ranks} batches at least (2 a rank, to time a layer): "
            f"--num-samples {args.num_samples} in --batch-size {args.batch_size} makes fewer"
        )
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
    calibrate = [*child, "calibrate", "--out", str(out)]
    if (
        args.ranks > 1
    ):  # torchrun runs the script itself: the interpreter's arguments go to torchrun
        calibrate = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.ranks),
            *calibrate[1:],
        ]
    a_wall, a_cpu, a_rss, a = run_measured(calibrate, env)
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
    tokens, ranks = a["tokens"], args.ranks
    hidden = tokens * SHAPE["hidden_size"] * 2 // ranks  # one process's share
    print(
        f"\nGPT-OSS-120B slice: {args.layers} layers, {tokens:,} tokens ({args.num_samples} x <= {args.max_seq_len}),"
        f" batch {args.batch_size}, {ranks} rank(s) x {args.threads} thread(s)"
        f"{' under torchrun' if ranks > 1 else ''}; {a['compute']}"
    )
    if ranks > 1:
        print(
            "  (rank 0's timings and disk counters; wall and CPU of the whole torchrun tree; peak RSS: its largest "
            "process, wait4's maxrss, which Linux takes over the children: not their sum)"
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
    # the whole model: kvcalib's own defaults for samples and length
    defaults = full_run()
    full_samples, full_seq = defaults["num_samples"], defaults["max_seq_len"]
    load_s = sum(loads) / len(loads) if loads else (a["observe_s"] - a_compute) / args.layers
    per_token = per_layer / tokens  # seconds per token per layer, all ranks together
    scale = flops_per_token(full_seq) / flops_per_token(args.max_seq_len)
    full_tokens = full_samples * full_seq
    measured_cores = ranks * args.threads
    speedup = args.speedup or 96 / measured_cores * args.efficiency
    # (1) load: each layer read + dequantised once; (2) observe: the decoder over every token
    load = FULL_LAYERS * load_s
    observe = FULL_LAYERS * full_tokens * per_token * scale
    # (3) the search: whole batches until SAMPLE_TOKENS a layer, whatever the budget: scaled by the K/V tokens
    sampled = sampled_tokens(args.batch_size, full_seq) / sampled_tokens(
        args.batch_size, args.max_seq_len
    )
    search = FULL_LAYERS * a["objective_s"] / args.layers * sampled
    full_hidden = full_tokens * SHAPE["hidden_size"] * 2
    print(
        f"\nwhole GPT-OSS-120B ({FULL_LAYERS} layers, kvcalib's defaults {full_samples} x {full_seq} = "
        f"{full_tokens:,} tokens), predicted from the parts measured here:"
    )
    print(
        f"  load     {FULL_LAYERS} x {load_s:.1f} s (a layer's read + dequantise) = {load / 60:.1f} min; not "
        "scaled with cores (the read is the disk's, the dequantisation scaled only partly)"
    )
    print(
        f"  observe  {per_token * 1e3:.3f} ms/token/layer at {args.max_seq_len} tokens x {scale:.2f} (FLOPs at "
        f"{full_seq}) x {full_tokens:,} tokens x {FULL_LAYERS} = {observe / 3600:.2f} h here"
    )
    print(
        f"  search   {a['objective_s']:.1f} s / {args.layers} layers x {FULL_LAYERS} x {sampled:.1f} (the K/V "
        f"tokens it samples at the defaults over here) = {search / 60:.1f} min here"
    )
    print(f"  write    links + ~{written / 1e3:.0f} kB (measured here): no time to speak of")
    print(
        f"  192-vCPU host: observe and search compute / S, S = 96 cores / ({ranks} x {args.threads} measured) x "
        f"efficiency {args.efficiency:g} = {speedup:.1f}"
        + (f" (given: --speedup {args.speedup:g})" if args.speedup else "")
        + "; the load not scaled"
    )
    for name, by in ((f"this machine ({ranks} x {args.threads})", 1.0), ("192-vCPU host", speedup)):
        print(f"  {name}: {(load + (observe + search) / by) / 3600:.2f} h")
    print(
        f"  peak RSS (one process): {(a_rss - hidden) / GiB:.1f} GiB + its hidden states "
        f"{full_hidden / ranks / GiB:.1f} GiB (spilled to disk where that is over half the free memory)"
    )
    print(
        f"  disk read {(FULL_LAYERS * layer_disk + rest_disk) / GiB:.0f} GiB (the released files once); written "
        f"~{written / 1e3:.0f} kB + links, and with a spill {FULL_LAYERS * full_hidden / GiB:.0f} GiB of hidden "
        "states written and read back (once a layer)"
    )


if __name__ == "__main__":
    main()
