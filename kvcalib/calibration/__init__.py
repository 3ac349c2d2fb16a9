"""The calibrate job: per-layer K/V absmax over a dataset -> FP8 scales -> a new checkpoint (pipeline.py).
Public entry: kvcalib.calibrate (kvcalib/api.py)."""
