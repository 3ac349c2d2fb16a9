"""calibrate: per-layer K/V absmax over a dataset -> FP8 scales -> a new checkpoint (see pipeline.py)."""

from kvcalib.calibrate.engine import Engine, EngineInputs, Observation
from kvcalib.calibrate.options import CalibrateOptions, CalibrationResult, LayerScales
from kvcalib.calibrate.pipeline import ENGINES, calibrate, register_engine
from kvcalib.calibrate.ranks import Ranks

__all__ = [
    "ENGINES", "CalibrateOptions", "CalibrationResult", "Engine", "EngineInputs", "LayerScales", "Observation",
    "Ranks", "calibrate", "register_engine",
]
