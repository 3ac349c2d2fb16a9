"""Run `calibrate` under an address-space cap (RLIMIT_AS), for test_scale.py.

    python tests/support/capped_calibrate.py ENGINE MODEL DATASET OUT HEADROOM_MB SAMPLES SEQ_LEN [BF16_COMPUTE]

Everything a run needs besides the model (imports, the dataset cache, the tokenizer's
threads) is set up first; then the cap is this process's current address space plus
HEADROOM_MB, so the cap is about the model and not about the Python runtime. Prints one
JSON object: the result, or the error's class, message and hint.
"""

from __future__ import annotations

import json
import resource
import sys

from transformers import AutoTokenizer

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core.errors import KvcalibError
from kvcalib.core.records import to_json
from kvcalib.hf.data import load_calibration_data
from kvcalib.hf.memory import proc_status

engine, model, dataset, out, headroom_mb, samples, seq_len = sys.argv[1:8]
bf16_compute = sys.argv[8] if len(sys.argv) > 8 else "auto"
load_calibration_data(
    dataset,
    AutoTokenizer.from_pretrained(model),
    CalibrateOptions(num_samples=int(samples), max_seq_len=int(seq_len)),
)
cap = proc_status()["VmSize"] + (int(headroom_mb) << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
try:
    result = calibrate(
        model,
        dataset,
        out,
        CalibrateOptions(
            engine=engine,
            num_samples=int(samples),
            max_seq_len=int(seq_len),
            batch_size=4,
            bf16_compute=bf16_compute,
        ),
    )
except KvcalibError as err:
    print(json.dumps({"error": type(err).__name__, "message": err.message, "hint": err.hint}))
    sys.exit(1)
payload = to_json(result)
with open(f"{out}/kvcalib_calibration.json") as f:
    payload["engine"] = json.load(f)["engine"]
print(json.dumps(payload))
