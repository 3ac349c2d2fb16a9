"""The pure floor: errors, FP8 numerics, names and schemas, reading checkpoints, the host CPU, progress. Nothing
here imports transformers, datasets or anything above it in kvcalib."""
