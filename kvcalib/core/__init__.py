"""The pure floor: errors, FP8 numerics, names and schemas, reading checkpoints, the host CPU, progress.

Nothing here imports transformers (core.mxfp4 does, inside its functions), datasets or anything above it in kvcalib.
"""

from kvcalib.core.checkpoint import Checkpoint, CheckpointFiles, read_config, scan_checkpoint
from kvcalib.core.cpu import ComputePath, HostCpu, choose_compute
from kvcalib.core.errors import KvcalibError
from kvcalib.core.fp8 import DEFAULT_TARGET, TARGETS, Target, fake_quantize, get_target, scale_from_absmax
from kvcalib.core.progress import Progress, ProgressCallback
from kvcalib.core.schema import kv_only_quantization_config, neuron_scale_key, num_hidden_layers, scale_key

__all__ = ["DEFAULT_TARGET", "TARGETS", "Checkpoint", "CheckpointFiles", "ComputePath", "HostCpu", "KvcalibError",
           "Progress", "ProgressCallback", "Target", "choose_compute", "fake_quantize", "get_target",
           "kv_only_quantization_config", "neuron_scale_key", "num_hidden_layers", "read_config",
           "scale_from_absmax", "scale_key", "scan_checkpoint"]
