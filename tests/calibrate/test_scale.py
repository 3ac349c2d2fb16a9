"""Scale-out: layer-streamed calibration (== in memory), torchrun across processes (== one), memory caps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families import COMMON
from helpers import REPO, SCRIPTS, SUPPORT, build_tokenizer, scale_bits, torchrun
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvcalib.calibration import stream
from kvcalib.calibration.distributed import batch_shares
from kvcalib.calibration.options import CalibrateOptions, Machine
from kvcalib.calibration.pipeline import calibrate
from kvcalib.calibration.ranks import Ranks
from kvcalib.cli import app
from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.errors import UsageError
from kvcalib.core.schema import PROVENANCE_FILENAME
from kvcalib.hf.data import batched
from kvcalib.hf.memory import (
    MemoryLimit,
    available_memory,
    choose_engine,
    proc_status,
    release_free_memory,
    weight_bytes,
)

SMALL = dict(num_samples=12, max_seq_len=64, batch_size=4)


def absmax(result) -> list[tuple[float, float]]:
    return [(layer.k.absmax, layer.v.absmax) for layer in result.layers]


def build_tiny(arch: str, out: Path) -> Path:
    """Tiny checkpoints of other decoder families: per-layer sliding/full masks (Qwen2), scaled embeddings (Gemma)."""
    import transformers as tf

    tokenizer = build_tokenizer()
    common = dict(COMMON, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    config_cls, model_cls, extra = {
        "qwen2-sliding": (
            tf.Qwen2Config,
            tf.Qwen2ForCausalLM,
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        ),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {}),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common, **extra))
    with torch.no_grad():  # larger weights than the default init, so K/V have some range
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(8.0)
    model.save_pretrained(out, max_shard_size="60KB")
    tokenizer.save_pretrained(out)
    return out


# --- streamed == in memory -------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,dtype",
    [
        ("llama", "auto"),  # float32 checkpoint
        ("llama", "bfloat16"),  # cast on load, as from_pretrained casts
        (
            "qwen2-sliding",
            "auto",
        ),  # layer 0 full attention, layers 1-2 a sliding window of 8 (< the samples)
        ("gemma", "auto"),  # the embedding is scaled inside the model's forward
    ],
)
def test_streamed_scales_equal_in_memory(arch, dtype, tiny_llama_master, text_dataset, tmp_path):
    model = tiny_llama_master if arch == "llama" else build_tiny(arch, tmp_path / arch)
    native = calibrate(
        model,
        str(text_dataset),
        tmp_path / "native",
        CalibrateOptions(engine="native", dtype=dtype, **SMALL),
    )
    streamed = calibrate(
        model,
        str(text_dataset),
        tmp_path / "stream",
        CalibrateOptions(engine="stream", dtype=dtype, **SMALL),
    )
    assert absmax(streamed) == absmax(native)
    assert scale_bits(tmp_path / "stream") == scale_bits(tmp_path / "native")
    assert json.loads((tmp_path / "stream" / PROVENANCE_FILENAME).read_text())["engine"] == "stream"
    assert streamed.validation.ok is True


def test_streamed_equals_in_memory_only_with_each_layers_own_mask(tmp_path, text_dataset):
    """Guard for the Qwen2 case above: each layer's own inputs are captured, and layer 0's would be wrong.

    Qwen2 with a sliding window from layer 1 on: the mask the decoder hands layer 1 differs from
    layer 0's (full causal), so giving every layer layer 0's inputs would change the scales.
    """
    from transformers import AutoModelForCausalLM

    from kvcalib.hf.attention import KVAbsmaxObserver

    model_dir = build_tiny("qwen2-sliding", tmp_path / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    decoder, layers = model.model, model.model.layers
    ids = torch.tensor([list(range(5, 25)), list(range(30, 50))])
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding, as calibrate batches
    observer = KVAbsmaxObserver(len(layers))
    with torch.inference_mode():
        _, _, first = stream.capture_layer_inputs(decoder, layers, 0, ids, mask, observer)
        _, _, second = stream.capture_layer_inputs(decoder, layers, 1, ids, mask, observer)
    full, sliding = first["attention_mask"], second["attention_mask"]
    assert (
        isinstance(full, torch.Tensor)
        and isinstance(sliding, torch.Tensor)
        and not torch.equal(full, sliding)
    )
    assert all(
        type(layer).forward is layer.forward.__func__ for layer in layers
    )  # the stand-ins are gone
    native = calibrate(
        model_dir,
        str(text_dataset),
        tmp_path / "native",
        CalibrateOptions(engine="native", **SMALL),
    )
    streamed = calibrate(
        model_dir,
        str(text_dataset),
        tmp_path / "stream",
        CalibrateOptions(engine="stream", **SMALL),
    )
    assert absmax(streamed) == absmax(native)


@pytest.mark.slow
def test_streamed_smollm2_equals_in_memory(smollm2, text_dataset, tmp_path):
    opts = dict(num_samples=6, max_seq_len=128, batch_size=2)
    native = calibrate(
        smollm2, str(text_dataset), tmp_path / "native", CalibrateOptions(engine="native", **opts)
    )
    streamed = calibrate(
        smollm2, str(text_dataset), tmp_path / "stream", CalibrateOptions(engine="stream", **opts)
    )
    assert len(streamed.layers) == 30
    assert absmax(streamed) == absmax(native)
    assert scale_bits(tmp_path / "stream") == scale_bits(tmp_path / "native")


def _spill_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("kvcalib-hidden-*"))


def test_hidden_states_spill_to_disk_and_are_cleaned_up(tiny_llama_master, text_dataset, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # any hidden state is "too large"
    spill = Machine.read(
        CalibrateOptions(), memory=MemoryLimit(0, "a test's machine"), scratch_dir=scratch
    )
    spilled: list[int] = []

    def watch(progress) -> None:
        if progress.stage == "observe":
            spilled.append(
                sum(len(list(d.glob("batch-*.safetensors"))) for d in _spill_dirs(scratch))
            )

    native = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "native",
        CalibrateOptions(engine="native", **SMALL),
    )
    streamed = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "stream",
        CalibrateOptions(engine="stream", **SMALL),
        spill,
        progress=watch,
    )
    assert spilled and min(spilled) == 3, (
        "12 samples in batches of 4: one file per batch while layers run"
    )
    assert absmax(streamed) == absmax(native)
    assert _spill_dirs(scratch) == []


def test_interrupted_stream_leaves_no_spill_and_no_output(
    tiny_llama_master, text_dataset, tmp_path
):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    spill = Machine.read(
        CalibrateOptions(), memory=MemoryLimit(0, "a test's machine"), scratch_dir=scratch
    )

    def interrupt_at_layer_1(progress) -> None:
        if progress.stage == "observe" and progress.layer == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(
            tiny_llama_master,
            str(text_dataset),
            tmp_path / "out",
            CalibrateOptions(engine="stream", **SMALL),
            spill,
            progress=interrupt_at_layer_1,
        )
    assert _spill_dirs(scratch) == []
    assert not (tmp_path / "out").exists()


def test_cli_stream_layers(tiny_llama_master, text_dataset, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(out),
            "--num-samples",
            "8",
            "--max-seq-len",
            "64",
            "--stream-layers",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / PROVENANCE_FILENAME).read_text())["engine"] == "stream"
    assert [layer["layer"] for layer in json.loads(result.stdout)["layers"]] == [0, 1, 2]


def test_stream_refuses_a_checkpoint_missing_a_layer_weight_before_any_work(
    tiny_llama, text_dataset, tmp_path
):
    from kvcalib.core.errors import UnsupportedModelError

    index_path = tiny_llama / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.2.mlp.down_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelError) as err:
        calibrate(
            tiny_llama,
            str(text_dataset),
            tmp_path / "out",
            CalibrateOptions(engine="stream", **SMALL),
        )
    assert err.value.message == (
        f"{tiny_llama}: the model's weight model.layers.2.mlp.down_proj.weight is not in "
        "the checkpoint's safetensors files"
    )


# --- the engine choice -----------------------------------------------------------------------


def test_weight_bytes_are_counted_in_the_calibration_dtype(tiny_llama_master):
    f32 = weight_bytes(tiny_llama_master, None)  # the checkpoint is float32
    assert f32 == sum(
        t.numel() * 4
        for p in tiny_llama_master.glob("*.safetensors")
        for t in load_file(p).values()
    )
    assert weight_bytes(tiny_llama_master, torch.bfloat16) == f32 // 2


def test_freed_heap_memory_goes_back_to_the_system_between_layers():
    """What the stream engine calls after each layer: blocks freed in the middle of glibc's heap (as a forward's
    activations leave them, each pinned by a later allocation) stay resident until release_free_memory."""
    import ctypes

    if not release_free_memory():
        pytest.skip(
            "no glibc malloc_trim here (musl or macOS): the stream engine skips the call too"
        )
    libc = ctypes.CDLL(None)  # the C library this process runs on
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks, pins = [], []
    for _ in range(
        1000
    ):  # 100 kB blocks: under glibc's smallest mmap threshold, so they come from the heap
        block = libc.malloc(100_000)
        ctypes.memset(block, 1, 100_000)
        blocks.append(block)
        pins.append(
            libc.malloc(20_000)
        )  # too large for the small free lists: taken from the heap's top, after it
        ctypes.memset(pins[-1], 1, 20_000)
    for block in blocks:
        libc.free(block)
    held = proc_status()["VmRSS"]
    assert release_free_memory()
    released = held - proc_status()["VmRSS"]
    for pin in pins:
        libc.free(pin)
    assert released > 50 * 2**20, released


def test_auto_keeps_a_small_model_in_memory(tiny_llama_master):
    limit = available_memory()
    assert 0 < limit.available and limit.source
    checkpoint, cpu = Checkpoint.open(tiny_llama_master), torch.device("cpu")
    choice = choose_engine("auto", checkpoint, None, cpu, 1, limit)
    assert (choice.engine, choice.reason) == ("native", None)
    assert choose_engine("stream", checkpoint, None, cpu, 1, limit).engine == "stream"


# --- a memory cap the model does not fit in ----------------------------------------------------


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A synthetic Llama (hidden 1024, 16 layers) with 0.47 GiB of bf16 weights, one shard per layer; removed after."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from make_synthetic_llama import build_synthetic_llama
    finally:
        sys.path.pop(0)
    root = tmp_path_factory.mktemp("wide")
    size = build_synthetic_llama(
        root / "wide-llama",
        build_tokenizer(),
        hidden=1024,
        intermediate=4096,
        layers=16,
        heads=8,
        kv_heads=4,
    )
    yield root / "wide-llama", size
    shutil.rmtree(root, ignore_errors=True)


def _capped(
    engine: str, model: Path, dataset: Path, out: Path, headroom_mb: int
) -> tuple[int, dict]:
    # RLIMIT_AS counts address space, not memory in use: keep glibc from holding freed or merely
    # reserved space (per-thread arenas; a heap grown by large blocks that were never touched).
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(SUPPORT)]),
        MALLOC_ARENA_MAX="1",
        MALLOC_MMAP_THRESHOLD_="131072",
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "capped_calibrate.py"),
            engine,
            str(model),
            str(dataset),
            str(out),
            str(headroom_mb),
            "8",  # two batches of 4 x 32 tokens: the cap is about the weights, not the activations
            "32",
            "float32",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc.returncode, json.loads(lines[-1])


def test_streamed_run_completes_under_a_memory_cap_the_in_memory_run_cannot(
    wide_llama, text_dataset, tmp_path
):
    model, size = wide_llama
    headroom_mb = int(size * 0.6) >> 20  # the cap holds 60% of the weights on top of the runtime
    code, failed = _capped("native", model, text_dataset, tmp_path / "native", headroom_mb)
    assert code == 1 and failed["error"] == "OutOfMemoryError", failed
    assert failed["message"].startswith(
        "ran out of memory on cpu calibrating with the native engine ("
    )
    assert failed["hint"] == "rerun with --stream-layers (one decoder layer in memory at a time)"
    assert not (tmp_path / "native").exists()

    code, done = _capped("auto", model, text_dataset, tmp_path / "auto", headroom_mb)
    assert code == 0, done
    assert done["engine"] == "stream"
    reason = next(w for w in done["warnings"] if w.startswith("streaming the model layer by layer"))
    assert f"its weights need {size / 2**30:.2f} GiB in bfloat16" in reason and reason.endswith(
        "(RLIMIT_AS)"
    )

    # (that the streamed scales are the in-memory ones is test_streamed_smollm2_equals_in_memory's)


# --- across processes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes,batch_size,world",
    [
        ((9, 7, 7, 7, 5, 3, 3, 1, 1), 2, 2),  # ties across batch boundaries, a short last batch
        ((4,) * 8, 4, 2),  # all equal, two full batches
        (tuple(range(1, 12)), 3, 3),  # three ranks, last batch of 2
        ((5, 4, 3), 1, 3),  # one batch per rank
    ],
)
def test_batch_shares_are_whole_single_process_batches(sizes, batch_size, world):
    sequences = tuple(tuple([n] * n + [i]) for i, n in enumerate(sizes))  # distinct, lengths n + 1
    whole = batched(sequences, batch_size)
    per_rank = [batched(share, batch_size) for share in batch_shares(sequences, batch_size, world)]
    assert all(per_rank), "every rank gets work"
    assert sorted(b for rank in per_rank for b in rank) == sorted(whole)
    for rank in per_rank:  # each rank's batches are single-process batches, in the same order
        positions = [whole.index(b) for b in rank]
        assert positions == sorted(positions)


def test_batch_shares_refuse_more_processes_than_batches():
    with pytest.raises(UsageError) as err:
        batch_shares(((1, 2), (3,)), 2, 2)
    assert err.value.message == "1 batch(es) of 2 cannot be split across 2 processes"


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, None),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            Ranks(1, 4, 1, 2),
        ),
        ({"RANK": "0", "WORLD_SIZE": "1"}, Ranks(0, 1, 0, 1)),
        (
            {"RANK": "x", "WORLD_SIZE": "2"},
            "RANK='x' WORLD_SIZE='2' LOCAL_RANK=None are not integers",
        ),
        (
            {"RANK": "2", "WORLD_SIZE": "2"},
            "RANK=2 WORLD_SIZE=2 LOCAL_RANK=2 LOCAL_WORLD_SIZE=2 do not describe a valid launch",
        ),
    ],
)
def test_ranks_from_torchrun_env(env, expected):
    if isinstance(expected, str):
        with pytest.raises(UsageError) as err:
            Ranks.from_env(env)
        assert err.value.message == expected
    else:
        assert Ranks.from_env(env) == expected


CLI_ARGS = ["--num-samples", "24", "--max-seq-len", "64", "--batch-size", "4"]


@pytest.mark.proof("torchrun")
@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
@pytest.mark.parametrize("mode", ["raise", "die"])
def test_a_failing_rank_does_not_hang_the_others(mode, tiny_llama_master, text_dataset, tmp_path):
    proc = torchrun(
        *[
            str(SUPPORT / "torchrun_faulty_rank.py"),
            mode,
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "out"),
            *CLI_ARGS,
        ],
        timeout=120,
    )
    assert proc.returncode != 0
    assert not (tmp_path / "out").exists()
    if mode == "raise":  # rank 0 reports rank 1's error, once
        assert (
            proc.stderr.count(
                "error: 1 of 2 processes failed during calibration (rank 1: rank one's scratch disk "
                "is full); nothing was written"
            )
            == 1
        ), proc.stderr[-3000:]


@pytest.mark.proof("torchrun")
@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
def test_more_processes_than_batches_is_a_usage_error_on_every_rank(
    tiny_llama_master, text_dataset, tmp_path
):
    proc = torchrun(
        *[
            "-m",
            "kvcalib",
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "out"),
            "--num-samples",
            "3",
            "--batch-size",
            "4",
        ],
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("error: 1 batch(es) of 4 cannot be split across 2 processes") == 1, (
        proc.stderr[-3000:]
    )
