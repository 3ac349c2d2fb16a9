"""Hostile inputs against every command: a clear refusal, nothing lost, nothing left behind.

Each case builds a world (the tiny model, a dataset, a calibrated checkpoint, a recipe and
sometimes an existing output), spoils one thing, runs the CLI in-process and asserts:

- the exit code;
- that the message names the thing (file, key, layer or flag) and carries a hint;
- no traceback (no exception escapes the CLI but typer's exit);
- every byte of the world is unchanged: the inputs, OUT (absent or as it was), and no
  temporary or old sibling next to OUT.

A case that hangs (a FIFO read by mistake) fails after HANG_S seconds instead of blocking.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from checkpoints import read_json, sync_index, write_json
from safetensors.torch import save_file
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.core.checkpoint import read_safetensors_header
from kvcalib.core.schema import INDEX_FILENAME, PROVENANCE_FILENAME, SCALES_FILENAME

HANG_S = 60
REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0


@dataclass
class World:
    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def data(self) -> Path:
        return self.root / "data.jsonl"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def fmt(self, arg: str) -> str:
        return arg.format(
            model=self.model,
            data=self.data,
            ckpt=self.ckpt,
            recipe=self.recipe,
            out=self.out,
            w=self.root,
        )


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    exit: int
    names: str  # what the message must name (a substring of the output), formatted like argv
    setup: Callable[[World], None] = lambda w: None
    hint: bool = (
        True  # False: a choice the CLI rejects itself, naming the flag and listing the choices
    )
    root: bool = False  # needs root (mounts, chattr)
    cleanup: Callable[[World], None] = lambda w: None
    json_finding: str | None = None  # validate: a finding with this severity must name the thing
    marks: tuple = field(default=())


# --- world building ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world_master(
    tmp_path_factory, tiny_llama_master: Path, short_dataset: Path, handmade_master: Path
) -> Path:
    root = tmp_path_factory.mktemp("world")
    shutil.copytree(tiny_llama_master, root / "model")
    shutil.copy(short_dataset, root / "data.jsonl")
    shutil.copytree(handmade_master, root / "ckpt")
    shutil.copy(REPO / "recipes" / "kv-fp8-trn2.yaml", root / "recipe.yaml")
    return root


@pytest.fixture
def world(world_master: Path, tmp_path: Path) -> World:
    shutil.copytree(world_master, tmp_path / "w", symlinks=True)
    return World(tmp_path / "w")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root`: its kind, mode and bytes (files), target (links). FIFOs are not opened."""
    entries: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                entries[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                digest = (
                    hashlib.sha256(path.read_bytes()).hexdigest()
                    if os.access(path, os.R_OK) or IS_ROOT
                    else "?"
                )
                entries[rel] = ("file", st.st_mode, digest)
            else:
                entries[rel] = ("other", st.st_mode)
    return entries


class Hung(Exception):
    pass


def run_cli(argv: list[str]):
    def alarm(signum, frame):
        raise Hung(f"kvcalib {' '.join(argv)} did not finish in {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_S)
    try:
        return CliRunner().invoke(app, argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- spoilers ----------------------------------------------------------------------------------


def existing_out(w: World) -> None:
    shutil.copytree(w.ckpt, w.out)


def mkfifo(path_of: Callable[[World], Path]) -> Callable[[World], None]:
    def setup(w: World) -> None:
        path = path_of(w)
        if path.exists():
            path.unlink() if path.is_file() else shutil.rmtree(path)
        os.mkfifo(path)

    return setup


def mkdir_at(path_of: Callable[[World], Path]) -> Callable[[World], None]:
    def setup(w: World) -> None:
        path = path_of(w)
        if path.exists():
            path.unlink()
        path.mkdir()
        (path / "x").write_text("x")

    return setup


def write_text(path_of: Callable[[World], Path], text: str) -> Callable[[World], None]:
    def setup(w: World) -> None:
        path_of(w).write_text(text)

    return setup


def jsonl(rows: list) -> Callable[[World], None]:
    def setup(w: World) -> None:
        w.data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    return setup


def edit_config(**changes) -> Callable[[World], None]:
    def setup(w: World) -> None:
        config = read_json(w.model / "config.json")
        config.update(changes)
        write_json(w.model / "config.json", config)

    return setup


def drop_layer_tensors(w: World) -> None:
    """config.json says 3 layers, the shards hold 2: the last layer's tensors removed."""
    for path in sorted(w.model.glob("*.safetensors")):
        from safetensors.torch import load_file

        tensors = load_file(path)
        kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")}
        if len(kept) != len(tensors):
            save_file(kept, path, metadata={"format": "pt"})
    sync_index(w.model)


def extra_tensor(w: World) -> None:
    path = min(w.model.glob("*.safetensors"))
    from safetensors.torch import load_file

    tensors = load_file(path)
    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(4, 4)
    save_file(tensors, path, metadata={"format": "pt"})
    sync_index(w.model)


def index_names_missing_shard(w: World) -> None:
    index = read_json(w.model / INDEX_FILENAME)
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    write_json(w.model / INDEX_FILENAME, index)


def remove_a_shard(w: World) -> None:
    index = read_json(w.model / INDEX_FILENAME)
    victim = max(set(index["weight_map"].values()))
    (w.model / victim).unlink()


def truncate_a_shard(w: World) -> None:
    path = min(w.model.glob("*.safetensors"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def remove_all_weights(w: World) -> None:
    for path in w.model.glob("*.safetensors"):
        path.unlink()
    (w.model / INDEX_FILENAME).unlink()


def scales_file(w: World) -> Path:
    return w.ckpt / SCALES_FILENAME


def overlapping_scales(w: World) -> None:
    """kv_scales.safetensors whose second tensor starts inside the first (safetensors refuses it)."""
    path = scales_file(w)
    header = read_safetensors_header(path)
    raw = path.read_bytes()
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + n])
    keys = sorted(
        (k for k in meta if k != "__metadata__"), key=lambda k: meta[k]["data_offsets"][0]
    )
    meta[keys[1]]["data_offsets"] = list(meta[keys[0]]["data_offsets"])
    new = json.dumps(meta).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[header.data_start :])


def hole_in_scales(w: World) -> None:
    """Tensor data with 4 bytes no tensor covers (the format forbids holes)."""
    path = scales_file(w)
    raw = path.read_bytes()
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    keys = sorted(
        (k for k in meta if k != "__metadata__"), key=lambda k: meta[k]["data_offsets"][0]
    )
    for k in keys:
        b, e = meta[k]["data_offsets"]
        meta[k]["data_offsets"] = [b + 4, e + 4]
    new = json.dumps(meta).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + b"\0\0\0\0" + data)


def scales_header_garbage(w: World) -> None:
    path = scales_file(w)
    path.write_bytes((12).to_bytes(8, "little") + b"{not json!!}" + b"\0" * 8)


def set_scale(value: float, provenance: bool = True) -> Callable[[World], None]:
    def setup(w: World) -> None:
        from safetensors.torch import load_file

        path = scales_file(w)
        tensors = load_file(path)
        tensors["model.layers.1.self_attn.k_scale"] = torch.tensor([value], dtype=torch.float32)
        save_file(tensors, path, metadata={"format": "pt"})
        if not provenance:
            (w.ckpt / PROVENANCE_FILENAME).unlink()

    return setup


def uncalibrated_ckpt(w: World) -> None:
    shutil.rmtree(w.ckpt)
    shutil.copytree(w.model, w.ckpt)


def chmod_000(path_of: Callable[[World], Path]) -> Callable[[World], None]:
    def setup(w: World) -> None:
        os.chmod(path_of(w), 0)

    return setup


def read_only_mount(w: World) -> None:
    """OUT's parent is a read-only tmpfs (unmounted by the test)."""
    parent = w.root / "ro"
    parent.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(parent)], check=True)


def unmount_ro(w: World) -> None:
    subprocess.run(["umount", str(w.root / "ro")], check=False, capture_output=True)


def immutable_dir(w: World) -> None:
    """OUT's parent carries the immutable attribute (chattr +i): even root cannot create files in it."""
    (w.root / "imm").mkdir()
    if subprocess.run(
        ["chattr", "+i", str(w.root / "imm")], capture_output=True, check=False
    ).returncode:
        pytest.skip("this filesystem has no immutable attribute (chattr +i failed)")


def mutable_again(w: World) -> None:
    subprocess.run(["chattr", "-i", str(w.root / "imm")], capture_output=True, check=False)


def fake_vllm_python(w: World) -> None:
    (w.root / "bin").mkdir()


CAL = (
    "calibrate",
    "{model}",
    "--dataset",
    "{data}",
    "-o",
    "{out}",
    "--num-samples",
    "4",
    "--max-seq-len",
    "32",
)
VAL = ("validate", "{ckpt}", "--json")
EVAL = ("eval", "{ckpt}", "--dataset", "{data}", "--num-samples", "2", "--max-seq-len", "16")
SERVE = ("serve-check", "{ckpt}", "--device", "cpu")

CASES = [
    # outputs that overlap inputs, before anything is touched
    Case("out-is-model", CAL[:5] + ("{model}", "--overwrite"), 2, "{model}"),
    Case("out-inside-model", CAL[:5] + ("{model}/sub",), 2, "{model}"),
    Case("out-contains-model", CAL[:5] + ("{w}", "--overwrite"), 2, "{model}"),
    Case(
        "out-is-dataset-dir",
        ("calibrate", "{model}", "--dataset", "{w}/datadir", "-o", "{w}/datadir", "--overwrite"),
        2,
        "{w}/datadir",
        setup=lambda w: (
            w.root.joinpath("datadir").mkdir(),
            shutil.copy(w.data, w.root / "datadir"),
        ),
    ),
    Case("out-is-dataset-file", CAL[:5] + ("{data}", "--overwrite"), 2, "{data}"),
    Case(
        "out-inside-dataset-dir",
        ("calibrate", "{model}", "--dataset", "{w}/datadir", "-o", "{w}/datadir/o"),
        2,
        "{w}/datadir",
        setup=lambda w: (
            w.root.joinpath("datadir").mkdir(),
            shutil.copy(w.data, w.root / "datadir"),
        ),
    ),
    Case(
        "out-is-recipe",
        CAL[:5] + ("{recipe}", "--recipe", "{recipe}", "--overwrite"),
        2,
        "{recipe}",
    ),
    Case(
        "out-symlink-to-model",
        CAL[:5] + ("{w}/link", "--overwrite"),
        2,
        "{model}",
        setup=lambda w: (w.root / "link").symlink_to(w.model),
    ),
    Case(
        "out-dangling-symlink",
        CAL[:5] + ("{w}/dangling",),
        2,
        "{w}/dangling",
        setup=lambda w: (w.root / "dangling").symlink_to(w.root / "nowhere"),
    ),
    Case("out-exists", CAL, 2, "{out}", setup=existing_out),
    Case(
        "out-overwrite-not-a-checkpoint",
        CAL + ("--overwrite",),
        2,
        "{out}",
        setup=lambda w: (w.out.mkdir(), (w.out / "notes.txt").write_text("mine")),
    ),
    Case("out-is-file", CAL + ("--overwrite",), 2, "{out}", setup=write_text(lambda w: w.out, "x")),
    Case("out-parent-is-file", CAL[:5] + ("{data}/x",), 2, "{data}"),
    Case(
        "out-read-only-fs",
        CAL[:5] + ("{w}/ro/out",),
        1,
        "{w}/ro",
        setup=read_only_mount,
        root=True,
        cleanup=unmount_ro,
    ),
    Case(
        "out-immutable-parent",
        CAL[:5] + ("{w}/imm/out",),
        1,
        "{w}/imm",
        setup=immutable_dir,
        root=True,
        cleanup=mutable_again,
    ),
    # arguments, found before any model is loaded
    Case("num-samples-0", CAL[:7] + ("0",) + CAL[8:], 2, "--num-samples"),
    Case("batch-size-0", CAL + ("--batch-size", "0"), 2, "--batch-size"),
    Case("max-seq-len-0", CAL + ("--max-seq-len", "0"), 2, "--max-seq-len"),
    Case("target-unknown", CAL + ("--target", "trn9"), 2, "trn9", hint=False),
    Case("dtype-unknown", CAL + ("--dtype", "float8"), 2, "--dtype", hint=False),
    Case("engine-unknown", CAL + ("--engine", "warp"), 2, "--engine", hint=False),
    Case("device-unknown", CAL + ("--device", "tpu"), 2, "--device", hint=False),
    Case("bf16-compute-unknown", CAL + ("--bf16-compute", "fast"), 2, "--bf16-compute", hint=False),
    Case("recipe-missing", CAL + ("--recipe", "{w}/nope.yaml"), 2, "{w}/nope.yaml"),
    Case(
        "recipe-is-dir",
        CAL + ("--recipe", "{w}/rdir"),
        2,
        "{w}/rdir",
        setup=lambda w: (w.root / "rdir").mkdir(),
    ),
    Case(
        "recipe-fifo",
        CAL + ("--recipe", "{recipe}"),
        2,
        "{recipe}",
        setup=mkfifo(lambda w: w.recipe),
    ),
    Case(
        "recipe-not-yaml",
        CAL + ("--recipe", "{recipe}"),
        2,
        "{recipe}",
        setup=write_text(lambda w: w.recipe, "a: [unclosed\n"),
    ),
    # the model
    Case("model-missing", ("calibrate", "{w}/nomodel") + CAL[2:], 2, "{w}/nomodel"),
    Case(
        "model-no-config", CAL, 2, "config.json", setup=lambda w: (w.model / "config.json").unlink()
    ),
    Case(
        "model-config-not-json",
        CAL,
        2,
        "config.json",
        setup=write_text(lambda w: w.model / "config.json", "{"),
    ),
    Case(
        "model-config-is-dir",
        CAL,
        2,
        "config.json",
        setup=mkdir_at(lambda w: w.model / "config.json"),
    ),
    Case(
        "model-config-fifo", CAL, 2, "config.json", setup=mkfifo(lambda w: w.model / "config.json")
    ),
    Case(
        "model-config-list",
        CAL,
        2,
        "config.json",
        setup=write_text(lambda w: w.model / "config.json", "[]"),
    ),
    Case("model-fewer-layers-than-config", CAL, 1, "model.layers.2", setup=drop_layer_tensors),
    Case(
        "model-unexpected-tensor", CAL, 1, "model.layers.0.mlp.surprise.weight", setup=extra_tensor
    ),
    Case("model-vocab-mismatch", CAL, 1, "embed_tokens", setup=edit_config(vocab_size=300)),
    Case(
        "model-index-names-missing-shard",
        CAL,
        2,
        "model-00099-of-00099.safetensors",
        setup=index_names_missing_shard,
    ),
    Case("model-shard-deleted", CAL, 2, "safetensors", setup=remove_a_shard),
    Case("model-shard-truncated", CAL, 2, "safetensors", setup=truncate_a_shard),
    Case("model-no-weights", CAL, 1, "safetensors", setup=remove_all_weights),
    Case(
        "model-index-not-json",
        CAL,
        2,
        INDEX_FILENAME,
        setup=write_text(lambda w: w.model / INDEX_FILENAME, '{"weight_map": '),
    ),
    Case(
        "model-tokenizer-fifo",
        CAL,
        2,
        "tokenizer.json",
        setup=mkfifo(lambda w: w.model / "tokenizer.json"),
    ),
    Case(
        "model-dangling-file-link",
        CAL,
        2,
        "special_tokens_map.json",
        setup=lambda w: (
            (w.model / "special_tokens_map.json").unlink(missing_ok=True),
            (w.model / "special_tokens_map.json").symlink_to(w.root / "gone"),
        ),
    ),
    Case(
        "model-type-unsupported",
        CAL,
        1,
        "bert",
        setup=edit_config(model_type="bert", architectures=["BertModel"]),
    ),
    Case("model-layers-zero", CAL, 1, "num_hidden_layers", setup=edit_config(num_hidden_layers=0)),
    # the dataset
    Case("data-missing", CAL[:3] + ("{w}/none.jsonl",) + CAL[4:], 1, "{w}/none.jsonl"),
    Case("data-empty-jsonl", CAL, 1, "{data}", setup=write_text(lambda w: w.data, "")),
    Case("data-blank-lines", CAL, 1, "{data}", setup=write_text(lambda w: w.data, "\n\n\n")),
    Case(
        "data-bad-json-line",
        CAL,
        1,
        "{data}",
        setup=write_text(lambda w: w.data, '{"text": "a"}\n{"text": \n'),
    ),
    Case(
        "data-chat-no-content",
        CAL,
        1,
        "row 2",
        setup=jsonl(
            [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user"}]}]
        ),
    ),
    Case("data-chat-no-role", CAL, 1, "row 1", setup=jsonl([{"messages": [{"content": "hi"}]}])),
    Case(
        "data-chat-int-content",
        CAL,
        1,
        "row 1",
        setup=jsonl([{"messages": [{"role": "user", "content": 7}]}]),
    ),
    Case("data-chat-not-dicts", CAL, 1, "{data}", setup=jsonl([{"messages": ["hi", "there"]}])),
    Case("data-number-column", CAL, 1, "'text'", setup=jsonl([{"text": 1}, {"text": 2}])),
    Case("data-no-text-column", CAL, 1, "'text'", setup=jsonl([{"body": "hello"}])),
    Case("data-text-column-missing", CAL + ("--text-column", "body"), 1, "body"),
    Case("data-fifo", CAL, 1, "{data}", setup=mkfifo(lambda w: w.data)),
    Case("data-device", CAL[:3] + ("/dev/null",) + CAL[4:], 1, "/dev/null"),
    Case(
        "data-dir-empty",
        CAL[:3] + ("{w}/empty",) + CAL[4:],
        1,
        "{w}/empty",
        setup=lambda w: (w.root / "empty").mkdir(),
    ),
    Case("data-split-local", CAL + ("--split", "test"), 1, "test"),
    Case(
        "data-unsupported-suffix",
        CAL[:3] + ("{w}/d.xml",) + CAL[4:],
        1,
        "{w}/d.xml",
        setup=write_text(lambda w: w.root / "d.xml", "<a/>"),
    ),
    # validate
    Case("validate-missing", ("validate", "{w}/none"), 2, "{w}/none"),
    Case(
        "validate-config-fifo",
        VAL,
        2,
        "config.json",
        setup=mkfifo(lambda w: w.ckpt / "config.json"),
    ),
    Case(
        "validate-config-dir",
        VAL,
        2,
        "config.json",
        setup=mkdir_at(lambda w: w.ckpt / "config.json"),
    ),
    Case(
        "validate-config-not-json",
        VAL,
        2,
        "config.json",
        setup=write_text(lambda w: w.ckpt / "config.json", "nope"),
    ),
    Case(
        "validate-overlapping-offsets",
        VAL,
        1,
        SCALES_FILENAME,
        setup=overlapping_scales,
        json_finding="error",
    ),
    Case(
        "validate-hole-in-data", VAL, 1, SCALES_FILENAME, setup=hole_in_scales, json_finding="error"
    ),
    Case(
        "validate-header-garbage",
        VAL,
        1,
        SCALES_FILENAME,
        setup=scales_header_garbage,
        json_finding="error",
    ),
    Case(
        "validate-absurd-scale-no-provenance",
        VAL + ("--strict",),
        1,
        "model.layers.1.self_attn.k_scale",
        setup=set_scale(1e30, provenance=False),
        json_finding="warning",
    ),
    Case(
        "validate-tiny-scale-no-provenance",
        VAL + ("--strict",),
        1,
        "model.layers.1.self_attn.k_scale",
        setup=set_scale(1e-30, provenance=False),
        json_finding="warning",
    ),
    Case(
        "validate-absurd-scale",
        VAL + ("--strict",),
        1,
        "model.layers.1.self_attn.k_scale",
        setup=set_scale(1e30),
        json_finding="warning",
    ),
    Case(
        "validate-uncalibrated",
        VAL + ("--strict",),
        1,
        "no KV-cache scales",
        setup=uncalibrated_ckpt,
        json_finding="warning",
    ),
    Case("validate-target-unknown", VAL + ("--target", "h100"), 2, "h100", hint=False),
    # eval
    Case("eval-uncalibrated", EVAL, 2, "k_scale", setup=uncalibrated_ckpt),
    Case("eval-num-samples-0", EVAL + ("--num-samples", "0"), 2, "--num-samples"),
    Case("eval-batch-size-0", EVAL + ("--batch-size", "0"), 2, "--batch-size"),
    Case("eval-max-seq-len-0", EVAL + ("--max-seq-len", "0"), 2, "--max-seq-len"),
    Case("eval-target-unknown", EVAL + ("--target", "x"), 2, "'x'", hint=False),
    Case("eval-compare-missing", EVAL + ("--compare", "{w}/other"), 2, "{w}/other"),
    Case("eval-data-fifo", EVAL, 1, "{data}", setup=mkfifo(lambda w: w.data)),
    Case("eval-plot-into-checkpoint", EVAL + ("--plot", "{ckpt}/x.png"), 2, "{ckpt}"),
    Case("eval-plot-not-png", EVAL + ("--plot", "{w}/x.jpg"), 2, "{w}/x.jpg"),
    Case("eval-missing", ("eval", "{w}/none", "--dataset", "{data}"), 2, "{w}/none"),
    # serve-check
    Case("serve-tp-0", SERVE + ("--tp", "0"), 2, "--tp"),
    Case("serve-max-model-len-0", SERVE + ("--max-model-len", "0"), 2, "--max-model-len"),
    Case("serve-max-num-seqs-0", SERVE + ("--max-num-seqs", "0"), 2, "--max-num-seqs"),
    Case("serve-port-out-of-range", SERVE + ("--port", "70000"), 2, "--port"),
    Case("serve-startup-timeout-0", SERVE + ("--startup-timeout", "0"), 2, "--startup-timeout"),
    Case("serve-stop-timeout-negative", SERVE + ("--stop-timeout", "-1"), 2, "--stop-timeout"),
    Case(
        "serve-vllm-python-missing",
        SERVE + ("--vllm-python", "{w}/bin/python"),
        3,
        "{w}/bin/python",
        setup=fake_vllm_python,
    ),
    Case(
        "serve-device-unknown",
        ("serve-check", "{ckpt}", "--device", "tpu"),
        2,
        "--device",
        hint=False,
    ),
    Case("serve-uncalibrated", SERVE, 1, "k_scale", setup=uncalibrated_ckpt),
    Case("serve-log-dir-in-checkpoint", SERVE + ("--log-dir", "{ckpt}/logs"), 2, "{ckpt}"),
    Case("serve-missing", ("serve-check", "{w}/none", "--device", "cpu"), 2, "{w}/none"),
    Case("serve-prompts-missing", SERVE + ("--prompts", "{w}/p.txt"), 2, "{w}/p.txt"),
    Case(
        "serve-prompts-fifo",
        SERVE + ("--prompts", "{w}/p.txt"),
        2,
        "{w}/p.txt",
        setup=mkfifo(lambda w: w.root / "p.txt"),
    ),
    Case(
        "serve-prompts-empty",
        SERVE + ("--prompts", "{w}/p.txt"),
        2,
        "{w}/p.txt",
        setup=write_text(lambda w: w.root / "p.txt", "\n"),
    ),
]


def test_corpus_is_large_and_covers_every_command():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.argv[0] for c in CASES} == {"calibrate", "validate", "eval", "serve-check"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hostile_input(case: Case, world: World):
    if case.root and not IS_ROOT:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        case.setup(world)
        before = snapshot(world.root)
        result = run_cli([world.fmt(a) for a in case.argv])
        after = snapshot(world.root)
    finally:
        case.cleanup(world)
    output = result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"traceback:\n{output}\n{result.exception!r}"
    )
    assert "Traceback" not in output
    assert result.exit_code == case.exit, output
    thing = world.fmt(case.names)
    if case.json_finding is not None:
        report = json.loads(result.stdout)
        hits = [
            f
            for f in report["findings"]
            if f["severity"] == case.json_finding and thing in f"{f['location']} {f['message']}"
        ]
        assert hits, json.dumps(report["findings"], indent=1)
        assert all(f["hint"] for f in hits), hits
    else:
        assert thing in output, output
        if case.hint:
            assert "hint:" in output, output
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert not changed, f"changed or left behind: {sorted(changed)}\n{output}"


# --- permissions, for real: as an unprivileged user (root reads and writes through any mode) ------


def as_nobody(argv: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(home),
        "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "MPLCONFIGDIR": str(home / "mpl"),
    }
    return subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            sys.executable,
            "-m",
            "kvcalib",
            *argv,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


PERMISSION_CASES = [
    # (id, spoil (as root), argv, exit, what the message names)
    (
        "validate-config-unreadable",
        lambda w: os.chmod(w.ckpt / "config.json", 0),
        VAL,
        2,
        "config.json",
    ),
    ("calibrate-data-unreadable", lambda w: os.chmod(w.data, 0), CAL, 1, "{data}"),
    (
        "calibrate-out-parent-not-writable",
        lambda w: w.root.joinpath("locked").mkdir(mode=0o555),
        CAL[:5] + ("{w}/locked/out",),
        1,
        "{w}/locked",
    ),
    (
        "eval-plot-dir-not-writable",
        lambda w: w.root.joinpath("locked").mkdir(mode=0o555),
        EVAL + ("--plot", "{w}/locked/p.png"),
        2,
        "{w}/locked",
    ),
]


@functools.cache
def nobody_can_run_kvcalib() -> str | None:
    """Why uid 65534 cannot run this checkout's kvcalib (a checkout under a private home), or None."""
    if not IS_ROOT or shutil.which("setpriv") is None:
        return "needs root and setpriv, to run kvcalib as the unprivileged user 65534"
    home = Path(tempfile.mkdtemp(prefix="kvcalib-perm-home-"))
    try:
        os.chmod(home, 0o777)
        done = as_nobody(["--version"], home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if done.returncode != 0:
        return f"uid 65534 cannot run {sys.executable} on this checkout: {(done.stderr or done.stdout).strip()[-200:]}"
    return None


@pytest.mark.proof("permissions")
@pytest.mark.parametrize("case", PERMISSION_CASES, ids=lambda c: c[0])
def test_permission_denied(case, world_master: Path):
    why = nobody_can_run_kvcalib()
    if why:
        pytest.skip(why)
    _id, spoil, argv, code, names = case
    base = Path(tempfile.mkdtemp(prefix="kvcalib-perm-"))
    try:
        os.chmod(base, 0o755)
        shutil.copytree(world_master, base / "w", symlinks=True)
        world = World(base / "w")
        (base / "home").mkdir()
        subprocess.run(["chown", "-R", "65534:65534", str(base / "home")], check=True)
        subprocess.run(["chmod", "-R", "a+rX", str(world.root)], check=True)
        os.chmod(world.root, 0o1777)  # OUT's parent: writable by the user, like /tmp
        spoil(world)
        before = snapshot(world.root)
        done = as_nobody([world.fmt(a) for a in argv], base / "home")
        output = done.stdout + done.stderr
        assert done.returncode == code, output
        assert "Traceback" not in output and "hint:" in output and "ermission denied" in output, (
            output
        )
        assert world.fmt(names) in output, output
        assert "KV scales for" not in output  # refused before calibrating
        assert snapshot(world.root) == before
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)
