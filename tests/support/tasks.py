"""Tiny lm-eval tasks as local YAML (no hub): a multiple-choice one and a generation one over the same items."""

from __future__ import annotations

import json
from pathlib import Path

ITEMS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "One, two,", "choices": [" three", " seven", " cat"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry", " square"], "answer": 0},
    {"question": "Monday, Tuesday,", "choices": [" Wednesday", " March", " blue"], "answer": 0},
    {"question": "The cat sat on the", "choices": [" mat", " sky", " seven"], "answer": 0},
    {"question": "Fire is", "choices": [" hot", " cold", " quiet"], "answer": 0},
]

MULTIPLE_CHOICE = """task: kvcalib_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {items}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GENERATION = """task: kvcalib_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {items}
validation_split: validation
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

PERPLEXITY = """task: kvcalib_tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {items}
validation_split: validation
output_type: loglikelihood_rolling
doc_to_text: "{{{{question}}}}{{{{choices[answer]}}}}"
doc_to_target: "{{{{question}}}}{{{{choices[answer]}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
"""


def write_tiny_tasks(folder: Path) -> Path:
    """The items and the tasks' YAML under `folder` (lm-eval's include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    items = folder / "items.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    for name, text in (
        ("tiny_mc", MULTIPLE_CHOICE),
        ("tiny_gen", GENERATION),
        ("tiny_ppl", PERPLEXITY),
    ):
        (folder / f"{name}.yaml").write_text(text.format(items=items))
    return folder
