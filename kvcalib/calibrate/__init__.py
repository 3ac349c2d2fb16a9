"""calibrate: per-layer K/V absmax over a dataset -> FP8 scales -> a new checkpoint (see pipeline.py).

The package is callable: `kvcalib.calibrate(model, dataset, output, target=...)` is kvcalib.calibrate.api.calibrate.
"""

from kvcalib.calibrate import api
from kvcalib.calibrate.engine import Engine, EngineInputs, Observation
from kvcalib.calibrate.options import CalibrateOptions, CalibrationResult, LayerScales
from kvcalib.calibrate.pipeline import ENGINES, calibrate, register_engine
from kvcalib.calibrate.ranks import Ranks
from kvcalib.core.modules import callable_package

__all__ = [
    "ENGINES", "CalibrateOptions", "CalibrationResult", "Engine", "EngineInputs", "LayerScales", "Observation",
    "Ranks", "calibrate", "register_engine",
]

callable_package(__name__, api.calibrate)
