"""CALIB-TOKENS-NOT-AS-SERVED: scales measured without the special tokens (BOS) vLLM's completions endpoint adds:
the `SpecialToken`s of the `single` template of tokenizer.json's TemplateProcessing post-processor. Judged from
kvcalib's provenance (`special_tokens`) only."""

from __future__ import annotations

from kvcalib.core.checkpoint import CheckpointFiles, read_json
from kvcalib.core.errors import KvcalibError
from kvcalib.core.schema import PROVENANCE_FILENAME
from kvcalib.validation.files import read_provenance
from kvcalib.validation.report import WARNING, Finding

__all__ = ["served_special_tokens", "token_findings"]

AS_SERVED = "as served"  # how the provenance's rule starts when rows were tokenised as vLLM does


def served_special_tokens(scan: CheckpointFiles) -> list[str]:
    """The special tokens tokenizer.json's post-processor puts around a plain prompt ([] if none or unknown)."""
    path = scan.root / "tokenizer.json"
    if not path.is_file():
        return []
    try:
        post = read_json(path, "tokenizer").get("post_processor")
    except (KvcalibError, AttributeError):
        return []
    processors = post.get("processors", []) if isinstance(post, dict) and post.get("type") == "Sequence" else [post]
    found = []
    for processor in processors:
        if isinstance(processor, dict) and processor.get("type") == "TemplateProcessing":
            for piece in processor.get("single") or []:
                special = piece.get("SpecialToken") if isinstance(piece, dict) else None
                if isinstance(special, dict) and isinstance(special.get("id"), str):
                    found.append(special["id"])
    return found


def token_findings(scan: CheckpointFiles) -> list[Finding]:
    provenance = read_provenance(scan)
    if provenance is None:
        return []
    rule = provenance.get("special_tokens")
    if isinstance(rule, str) and (rule.startswith(AS_SERVED) or rule.startswith("every row")):
        return []
    added = served_special_tokens(scan)
    if not added:
        return []
    how = "with --no-add-special-tokens" if isinstance(rule, str) else "by a kvcalib that added no special tokens"
    return [Finding(
        "CALIB-TOKENS-NOT-AS-SERVED", WARNING,
        f"the scales were measured on text without {', '.join(added)}, calibrated {how}, while vLLM adds "
        f"{'it' if len(added) == 1 else 'them'} to every completions prompt (tokenizer.json's post-processor): "
        "the server writes K/V the calibration never saw (the first position is the attention sink)",
        "recalibrate with `kvcalib calibrate` (its default tokenises as vLLM serves: plain text with the "
        "tokenizer's special tokens, chat-template text without)", PROVENANCE_FILENAME)]
