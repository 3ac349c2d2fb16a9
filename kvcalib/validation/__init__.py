"""The validate job: the Neuron platform's quantization-config rules, exactly, and the failures it lets through
(pipeline.py; report.py holds the findings). The public function is kvcalib.validate (kvcalib/api.py)."""
