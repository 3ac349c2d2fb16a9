"""The serve-check job: serve a checkpoint with vLLM's FP8 KV cache, probe it, judge it, always stop it
(pipeline.py). The public function is kvcalib.serve_check (kvcalib/api.py)."""
