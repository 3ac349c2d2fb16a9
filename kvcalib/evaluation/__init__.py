"""The eval job: FP8-KV accuracy with the target chip's own numerics, against an unquantised KV cache
(pipeline.py; tasks.py, context.py, needle.py the other probes). The public functions are kvcalib.evaluate and
its variants (kvcalib/api.py)."""
