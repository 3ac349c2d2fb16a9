"""The Hugging Face layer shared by calibrate and eval: model loading, the recording cache, data, compute."""
