"""A fake Neuron plugin: its presence makes the fake vLLM server behave as the Neuron platform."""
