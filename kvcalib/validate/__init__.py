"""validate: the Neuron platform's quantization-config rules, exactly, and the failures it lets through.

The package is callable: `kvcalib.validate(path, target=...)` is kvcalib.validate.api.validate.
"""

from kvcalib.core.modules import callable_package
from kvcalib.validate import api
from kvcalib.validate.config import neuron_quantization_verdict
from kvcalib.validate.pipeline import validate_checkpoint
from kvcalib.validate.report import ERROR, INFO, WARNING, Finding, ValidationReport

__all__ = ["ERROR", "INFO", "WARNING", "Finding", "ValidationReport", "neuron_quantization_verdict",
           "validate_checkpoint"]

callable_package(__name__, api.validate)
