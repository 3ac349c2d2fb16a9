"""The Hugging Face layer shared by calibrate and eval: model loading, the recording cache, data, compute."""

from kvcalib.hf.attention import KVAbsmaxObserver, RecordingCache, attention_modules, observe_batch
from kvcalib.hf.compute import bf16_via_float32, compute_path
from kvcalib.hf.data import CalibrationData, batches, load_calibration_data
from kvcalib.hf.model import load_model, load_tokenizer, resolve_model_dir

__all__ = ["CalibrationData", "KVAbsmaxObserver", "attention_modules", "batches", "bf16_via_float32", "compute_path",
           "load_calibration_data", "load_model", "load_tokenizer", "observe_batch", "RecordingCache",
           "resolve_model_dir"]
