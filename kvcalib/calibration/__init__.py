"""The calibrate job: per-layer K/V absmax over a dataset -> FP8 scales -> a new checkpoint (pipeline.py).

options.py declares what it takes; engine.py the engines' interface (register your own with
pipeline.register_engine); the public function is kvcalib.calibrate (kvcalib/api.py)."""
