"""The validate job: the Neuron platform's quantization-config rules, exactly, and the failures it lets through
(pipeline.py; report.py: the findings; rules.py: every code). The public function is kvcalib.validate (api.py)."""
