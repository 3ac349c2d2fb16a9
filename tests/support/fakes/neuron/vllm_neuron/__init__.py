"""A fake Neuron plugin (vllm-neuron) for machines without a Neuron device.

Its presence makes the fake vLLM server behave as the Neuron platform. Its modules follow the plugin's own code
paths where kvcalib's checkpoints meet them (the fork jinhuang12/vllm-neuron, read at ed3580d / ce02eaf):
- platform.py: `NeuronPlatform._validate_quantization_config` (vllm_neuron/vllm/platform.py) and the chip the
  plugin compiles for (`get_platform_target`);
- checkpoint.py: the safetensors tensors by name, across a checkpoint's files (vllm_neuron/utils/checkpoints.py);
- gpt_oss.py: GPT-OSS's factory and its two models' weight and KV-scale loading (vllm_neuron/model/gpt_oss/
  factory.py, model_bf16.py, model_mxfp4.py).
Standard library only, like the fake server.
"""
