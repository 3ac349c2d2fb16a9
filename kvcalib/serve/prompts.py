"""What serve-check asks the server: prompts with well-known continuations, and a fixed text.

The prompts are ones any small instruction-tuned model completes the same way every time
under greedy decoding, so an FP8 server that answers differently from the bf16 one is
telling us something. The NLL text is public-domain prose (the opening of Dickens' "A Tale
of Two Cities", 1859): its mean negative log-likelihood under prompt log-probs is a number
that moves when the KV cache is quantised badly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvcalib.core.errors import UsageError
from kvcalib.core.paths import require_regular_file

__all__ = ["BUILTIN_PROMPTS", "NLL_TEXT", "Prompt", "read_prompts_file"]


@dataclass(frozen=True)
class Prompt:
    text: str
    expected: str | None = None  # a word a sane continuation contains (informative, not judged)


BUILTIN_PROMPTS: tuple[Prompt, ...] = (
    Prompt("The capital of France is", "Paris"),
    Prompt("One, two, three, four, five,", "six"),
    Prompt("Monday, Tuesday, Wednesday,", "Thursday"),
    Prompt("January, February, March,", "April"),
    Prompt("The largest planet in the solar system is", "Jupiter"),
    Prompt("The opposite of hot is", "cold"),
)

NLL_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it was "
    "the winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way - in short, the period was "
    "so far like the present period, that some of its noisiest authorities insisted on its "
    "being received, for good or for evil, in the superlative degree of comparison only. "
    "There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne "
    "of France. In both countries it was clearer than crystal to the lords of the State "
    "preserves of loaves and fishes, that things in general were settled for ever."
)


def read_prompts_file(path: Path) -> tuple[Prompt, ...]:
    """Prompts from a file: .jsonl rows {"prompt": ..., "expected": ...}, else one per non-blank line."""
    hint = "pass a UTF-8 text file with one prompt per line, or a .jsonl with a 'prompt' key"
    path = require_regular_file(Path(path), "prompts file", error=UsageError, missing=UsageError, hint=hint)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read prompts file {path}: {err}",
                         hint="pass a UTF-8 text file with one prompt per line, or a .jsonl with a 'prompt' key") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            prompts.append(_jsonl_prompt(path, number, line))
        else:
            prompts.append(Prompt(line.rstrip("\n")))
    if not prompts:
        raise UsageError(f"prompts file {path} has no prompts", hint="one prompt per non-blank line")
    return tuple(prompts)


def _jsonl_prompt(path: Path, number: int, line: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}:{number}: not JSON ({err})", hint='each line: {"prompt": "..."}') from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise UsageError(f"{path}:{number}: no non-empty string 'prompt'", hint='each line: {"prompt": "..."}')
    expected = row.get("expected")
    return Prompt(row["prompt"], expected if isinstance(expected, str) and expected else None)
