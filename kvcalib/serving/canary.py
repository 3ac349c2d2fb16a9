"""The canary: does the server apply this checkpoint's KV scales, and the right way round?

serve-check also serves a variant whose every k_scale and v_scale is divided by CANARY_DIVISOR (K and V saturate FP8
at 1/64 of their range): answering like the checkpoint means the scales were not applied, answering better means
they were applied the wrong way round. A variant is a directory of symlinks to the checkpoint's files in which only
the safetensors files holding KV scales are rewritten."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.core.checkpoint import load_tensors, scan_checkpoint
from kvcalib.core.errors import UsageError
from kvcalib.core.schema import is_kv_scale_key

__all__ = [
    "CANARY_DIVISOR",
    "CanaryResult",
    "judge_canary",
    "make_variant",
]

CANARY_DIVISOR = 64.0  # measured on SmolLM2 / vLLM CPU: /100 makes it print "-" over and over
# nats: less than this on the fixed text, and the same outputs, is "no change"
MIN_NLL_CHANGE = 0.05
SAME_AGREEMENT = 0.01  # agreement within this of the calibrated run's is "the same"


@dataclass(frozen=True)
class CanaryResult:
    """serve-check's "canary": ok (the scales are applied, the right way round), factor (every K/V scale's), nll (of the
    fixed text, nats), agreement (mean top-1 agreement with the reference; null: none scored), reason."""

    ok: bool
    factor: float
    nll: float
    agreement: float | None
    reason: str


def make_variant(
    checkpoint: Path, dest: Path, *, factor: float | None = None, value: float | None = None
) -> Path:
    """`dest`: `checkpoint` with every KV scale times `factor` (or set to `value`), everything else symlinked.
    A variant an earlier serve-check left there (symlinks and .safetensors only) is replaced; anything else refused."""
    import torch
    from safetensors.torch import save_file

    if dest.exists() or dest.is_symlink():
        ours = (
            dest.is_dir()
            and not dest.is_symlink()
            and all(
                e.is_symlink() or (e.is_file() and e.suffix == ".safetensors")
                for e in dest.iterdir()
            )
        )
        if not ours:
            raise UsageError(
                f"{dest} exists and is not a checkpoint variant serve-check made",
                hint="pass another --log-dir, or move it away",
            )
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    headers = scan_checkpoint(checkpoint).headers
    rewrite = {
        name for name, header in headers.items() if any(map(is_kv_scale_key, header.tensors))
    }
    for entry in sorted(checkpoint.iterdir()):
        if entry.name not in rewrite:
            os.symlink(entry, dest / entry.name)
    for name in sorted(rewrite):
        tensors = load_tensors(checkpoint / name, headers[name].tensors)
        for key, tensor in tensors.items():
            if is_kv_scale_key(key):
                tensors[key] = (
                    torch.full_like(tensor, value) if value is not None else tensor * factor
                )
        save_file(tensors, str(dest / name), metadata=headers[name].metadata)
    return dest


def judge_canary(
    calibrated: Any, canary: Any, reference: float | None, device: str, server: str
) -> CanaryResult:
    """Compare the variant's run with the checkpoint's (two `ServerRun`s against the same reference; `reference`:
    the checkpoint's mean agreement with it)."""
    change, factor, agreement = canary.nll - calibrated.nll, 1 / CANARY_DIVISOR, canary.agreement
    same_text = [c.text for c in canary.completions] == [c.text for c in calibrated.completions]
    same_agreement = None in (agreement, reference) or abs(agreement - reference) < SAME_AGREEMENT
    shown = f"NLL {canary.nll:.3f} vs {calibrated.nll:.3f}" + (
        "" if agreement is None else f", agreement {agreement:.2f} vs {reference:.2f}"
    )
    ok = False
    if abs(change) < MIN_NLL_CHANGE and same_agreement and same_text:
        reason = (
            "the server did not apply the checkpoint's KV scales: with every scale "
            f"x{factor:g} it answered as with the calibrated ones ({shown}) on {device}, {server}"
        )
    elif change <= -MIN_NLL_CHANGE:
        reason = (
            f"the server applies the checkpoint's KV scales the wrong way round: every scale x{factor:g} served "
            f"better than the calibrated ones ({shown}) on {device}, {server}"
        )
    else:
        ok, reason = (
            True,
            f"scales x{factor:g} changed the answers ({shown}): the server applies the checkpoint's scales",
        )
    return CanaryResult(ok, factor, canary.nll, agreement, reason)
