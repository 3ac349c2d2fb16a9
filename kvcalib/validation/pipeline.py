"""`kvcalib validate`: will vLLM on Neuron accept this checkpoint, and use its scales? Reads config.json, the index,
the safetensors headers and the scale tensors only; every finding code, its severity and source: validation/rules.py,
rendered as scripts/VALIDATE_RULES.md."""

from __future__ import annotations

from pathlib import Path

from kvcalib.core import mxfp4
from kvcalib.core.checkpoint import read_config
from kvcalib.core.errors import UnknownTargetError
from kvcalib.core.fp8 import DEFAULT_TARGET, get_target
from kvcalib.validation.config import llama_gate, neuron_quantization_verdict, portability_findings
from kvcalib.validation.files import scan_for_validation
from kvcalib.validation.heads import attention_group_findings, query_findings
from kvcalib.validation.provenance import (
    outlier_findings,
    range_findings,
    read_provenance,
    token_findings,
)
from kvcalib.validation.report import Finding, ValidationReport
from kvcalib.validation.scales import scale_findings

__all__ = ["validate_checkpoint"]


def validate_checkpoint(
    path: Path,
    target: str = DEFAULT_TARGET,
    *,
    strict: bool = False,
    neuron_config: dict | None = None,
) -> ValidationReport:
    """Every finding for the checkpoint at `path` served on `target` ("trn2", "trn3", "gpu"); `neuron_config`: the
    serve command's `additional_config["neuron_config"]`, if known. Raises UnknownTargetError, CheckpointNotFoundError
    (no directory or config.json) and CheckpointReadError (config.json not a JSON object); all else is a Finding."""
    try:
        get_target(target)
    except ValueError as exc:
        raise UnknownTargetError(str(exc), hint="use --target trn2, trn3 or gpu") from None
    root = Path(path)
    config = read_config(root)
    verdict = neuron_quantization_verdict(config.get("quantization_config"), neuron_config)
    # the Llama model is built only once the platform has accepted the config
    first = verdict if verdict is not None else llama_gate(config)
    findings = [] if first is None else [first]
    scan, integrity = scan_for_validation(root)
    scales, check = scale_findings(config, scan, target)
    findings += scales + integrity
    provenance = read_provenance(scan)
    findings += range_findings(scan, check, target)
    findings += outlier_findings(config, scan, check, target, provenance)
    findings += token_findings(scan, provenance)
    findings += portability_findings(config, target, check.present)
    findings += query_findings(config, scan, target, check.per_head)
    findings += attention_group_findings(config, target)
    findings += [Finding(*found) for found in mxfp4.findings(config, scan.key_files, target)]
    return ValidationReport(str(path), target, tuple(findings), strict)
