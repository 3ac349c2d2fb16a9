"""What serve-check asks the server: prompts with well-known greedy continuations, a fixed public-domain text for
the NLL (Dickens, "A Tale of Two Cities"), and with --context a passkey prompt, the one judged prompt."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.core.errors import UsageError
from kvcalib.core.paths import require_regular_file

__all__ = [
    "BUILTIN_PROMPTS",
    "NLL_TEXT",
    "Prompt",
    "contains",
    "context_prompt",
    "passkey_prompt",
    "read_prompts_file",
]

# The passkey test's haystack (Mohtashami & Jaggi 2023, "Landmark Attention"): one line repeated, so that
# the key is the only thing in the prompt worth remembering.
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
)
PASSKEY = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
MIN_CONTEXT = 64  # tokens: below this the "long" prompt is no longer than the built-in ones


@dataclass(frozen=True)
class Prompt:
    text: str
    expected: str | None = None  # a word a sane continuation contains (informative, not judged)
    # judged: the FP8 output must contain `expected` where the baseline's does
    required: bool = False
    tokens: int | None = None  # the prompt's length in the model's tokens, where it was measured


def passkey_prompt(length: int, count_tokens: Callable[[str], int], seed: int = 0) -> Prompt:
    """A passkey prompt of about `length` tokens (at most `length`): the filler, a random 5-digit key halfway
    in, and the question at the end; `count_tokens(text)` counts as the server will (special tokens included)."""
    key = str(random.Random(f"passkey-{seed}-{length}").randint(10000, 99999))
    needle, question = PASSKEY.format(key=key), PASSKEY_QUESTION

    def build(lines: int) -> str:
        half = lines // 2
        return FILLER * half + needle + FILLER * (lines - half) + question

    shortest = count_tokens(build(1))
    if shortest > length:
        raise UsageError(
            f"--context {length}: the shortest passkey prompt is {shortest} tokens for this tokenizer",
            hint=f"pass --context {max(MIN_CONTEXT, shortest)} or more",
        )
    eight = count_tokens(build(9)) - shortest  # tokens of eight filler lines
    lines = 1 + max(0, (length - shortest) * 8 // max(1, eight))
    tokens = count_tokens(build(lines))
    while lines > 1 and tokens > length:  # the estimate is exact for most tokenizers
        lines -= 1
        tokens = count_tokens(build(lines))
    return Prompt(build(lines), key, required=True, tokens=tokens)


def contains(text: str, expected: str | None) -> bool:
    return expected is not None and expected.lower() in text.lower()


def context_prompt(checkpoint: Path, config: dict[str, Any], length: int) -> Prompt:
    """serve-check --context: the passkey prompt of about `length` tokens, counted with the checkpoint's tokenizer as
    vLLM's completions API counts them (special tokens added); UsageError past the model's context."""
    from kvcalib.core.schema import max_position_embeddings
    from kvcalib.hf.model import load_tokenizer

    most = max_position_embeddings(config)
    if most is not None and length > most:
        raise UsageError(
            f"--context {length} is longer than the model's context (max_position_embeddings {most})",
            hint=f"pass --context {most} or less",
        )
    tokenizer = load_tokenizer(checkpoint, trust_remote_code=False)
    return passkey_prompt(length, lambda text: len(tokenizer(text)["input_ids"]))


BUILTIN_PROMPTS: tuple[Prompt, ...] = (
    Prompt("The capital of France is", "Paris"),
    Prompt("One, two, three, four, five,", "six"),
    Prompt("Monday, Tuesday, Wednesday,", "Thursday"),
    Prompt("January, February, March,", "April"),
    Prompt("The largest planet in the solar system is", "Jupiter"),
    Prompt("The opposite of hot is", "cold"),
)

NLL_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it "
    "was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    "Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing "
    "before us, we were all going direct to Heaven, we were all going direct the other way - in short, the period was "
    "so far like the present period, that some of its noisiest authorities insisted on its being received, for good or "
    "for evil, in the superlative degree of comparison only. There were a king with a large jaw and a queen with a "
    "plain face, on the throne of England; there were a king with a large jaw and a queen with a fair face, on the "
    "throne of France. In both countries it was clearer than crystal to the lords of the State preserves of loaves and "
    "fishes, that things in general were settled for ever."
)


def read_prompts_file(path: Path) -> tuple[Prompt, ...]:
    """Prompts from a file: .jsonl rows {"prompt": ..., "expected": ...}, else one per non-blank line."""
    hint = "pass a UTF-8 text file with one prompt per line, or a .jsonl with a 'prompt' key"
    path = require_regular_file(
        Path(path), "prompts file", error=UsageError, missing=UsageError, hint=hint
    )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read prompts file {path}: {err}", hint=hint) from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(Prompt(line))
            continue
        try:
            row = json.loads(line)
            ok = (
                isinstance(row, dict)
                and isinstance(row.get("prompt"), str)
                and row["prompt"].strip()
            )
            why = None if ok else "no non-empty string 'prompt'"
        except json.JSONDecodeError as err:
            why = f"not JSON ({err})"
        if why:
            raise UsageError(f"{path}:{number}: {why}", hint='each line: {"prompt": "..."}')
        expected = row.get("expected")
        prompts.append(
            Prompt(row["prompt"], expected if isinstance(expected, str) and expected else None)
        )
    if not prompts:
        raise UsageError(
            f"prompts file {path} has no prompts", hint="one prompt per non-blank line"
        )
    return tuple(prompts)
