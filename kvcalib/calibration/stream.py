"""The "stream" engine: calibrate a model larger than memory, one decoder layer at a time.

The model is built on the meta device; the non-layer weights are loaded, then each layer in turn through
transformers' own load-time conversion (as `from_pretrained`), every batch's hidden states (spilled to disk when
they would not fit) go through it, and it goes back to meta. Each layer's inputs (masks, rotary cos/sin) are
captured from the model's own forward (capture_layer_inputs): the scales equal the in-memory engine's."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvcalib.calibration.engine import EngineInputs, Observation
from kvcalib.core import mxfp4
from kvcalib.core.checkpoint import Checkpoint, CheckpointFiles, load_tensors
from kvcalib.core.errors import UnsupportedModelError
from kvcalib.core.progress import Progress
from kvcalib.hf import internals
from kvcalib.hf.attention import (
    KVAbsmaxObserver,
    StopForward,
    observed_forward,
)
from kvcalib.hf.data import batches
from kvcalib.hf.memory import release_free_memory
from kvcalib.hf.model import (
    build_skeleton,
    check_loading_info,
    effective_dtype,
    faithful_attention,
    num_layers,
    text_config,
)
from kvcalib.hf.mxfp4 import expert_chunks

__all__ = [
    "HIDDEN_STATES_MEMORY_SHARE",
    "LayerStream",
    "capture_layer_inputs",
    "open_stream",
    "stream_engine",
]

# Hidden states stay in memory up to this share of the memory left after the streamed weights; beyond, on disk.
HIDDEN_STATES_MEMORY_SHARE = 0.5


@dataclass
class LayerStream:
    """A causal LM run one decoder layer at a time: its other weights loaded and each layer loaded from the
    checkpoint when reached (layer()), back to meta after."""

    model: torch.nn.Module
    decoder: torch.nn.Module
    layers: torch.nn.ModuleList
    weights: _Weights
    prefix: str  # the layers' state-dict path, e.g. "model.layers."

    @contextmanager
    def layer(self, i: int) -> Iterator[torch.nn.Module]:
        self.weights.load(f"{self.prefix}{i}.")
        try:
            yield self.layers[i]
        finally:
            self.layers[i].to("meta")  # frees the layer's weights
            release_free_memory()  # and the forward's freed activations, before the next layer loads


def open_stream(
    checkpoint: Checkpoint, dtype: torch.dtype | None, device: torch.device, trust_remote_code: bool
) -> LayerStream:
    """The model on the meta device, every weight checked findable, its non-layer weights loaded."""
    model_dir = checkpoint.root
    dtype = effective_dtype(checkpoint, dtype)
    model = build_skeleton(
        model_dir, dtype, trust_remote_code, faithful_attention(checkpoint.config)
    )
    decoder = getattr(model, model.base_model_prefix, model)
    prefix = f"{model.base_model_prefix}." if decoder is not model else ""
    found = [
        (name, child)
        for name, child in decoder.named_children()
        if isinstance(child, torch.nn.ModuleList) and len(child) == num_layers(model)
    ]
    if not found:
        raise UnsupportedModelError(
            f"{model_dir}: no list of {num_layers(model)} decoder layers found in {type(decoder).__name__}",
            hint="calibrate this model without --stream-layers",
        )
    layers_name, layers = found[0]
    weights = _Weights(model, model_dir, checkpoint.files, device, dtype)
    weights.check(prefix)  # every weight findable before the long work starts
    weights.load(prefix, skip=f"{prefix}{layers_name}.")
    return LayerStream(model, decoder, layers, weights, f"{prefix}{layers_name}.")


def stream_engine(inputs: EngineInputs) -> Observation:
    inputs.notify(Progress("load-model"))
    stream = open_stream(
        inputs.checkpoint, inputs.dtype, inputs.device, inputs.options.trust_remote_code
    )
    decoder, layers = stream.decoder, stream.layers
    batch_list = [
        (ids.to(inputs.device), mask.to(inputs.device))
        for ids, mask in batches(inputs.data.sequences, inputs.options.batch_size, inputs.pad_id)
    ]
    # spill when every batch's hidden states would take over a share of the memory this process has left beside a
    # layer and its load-time copy (the ranks on this host share it)
    hidden_bytes = sum(ids.numel() for ids, _ in batch_list) * int(text_config(decoder).hidden_size)
    largest = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    left = (
        inputs.memory.available
        // (inputs.machine.ranks.local_world_size if inputs.machine.ranks else 1)
        - 2 * largest
    )
    spill = hidden_bytes * stream.weights.dtype.itemsize > HIDDEN_STATES_MEMORY_SHARE * left
    samples, tokens = len(inputs.data.sequences), inputs.data.num_tokens

    def run(observer: KVAbsmaxObserver) -> None:
        with (
            tempfile.TemporaryDirectory(prefix="kvcalib-hidden-", dir=inputs.machine.scratch_dir)
            if spill
            else nullcontext() as folder
        ):
            states = _Spilled(folder) if spill else {}  # each batch's hidden states, on the CPU
            for b, (ids, mask) in enumerate(batch_list):  # the embeddings: layer 0's inputs
                states[b] = capture_layer_inputs(decoder, layers, 0, ids, mask, observer)[0].cpu()
            for i in range(len(layers))[: inputs.probe_layers]:
                with stream.layer(i) as layer:
                    for b, (ids, mask) in enumerate(batch_list):
                        _, args, kwargs = capture_layer_inputs(
                            decoder, layers, i, ids, mask, observer
                        )
                        # the last layer's observer stops the forward once its K/V (and Q) are seen
                        with observer.batch(ids, mask):
                            out = layer(states[b].to(inputs.device), *args, **kwargs)
                            states[b] = (out[0] if isinstance(out, tuple) else out).cpu()
                        # reported as through the whole model
                        done = (i * len(batch_list) + b + 1) / (len(layers) * len(batch_list))
                        inputs.notify(
                            Progress(
                                "observe",
                                int(done * samples),
                                samples,
                                int(done * tokens),
                                tokens,
                                i,
                                len(layers),
                            )
                        )

    return inputs.observe(stream.model, stream.model, run)


class _StandIn(torch.nn.Module):
    """In a decoder layer's place while capture_layer_inputs runs the decoder: hands the hidden states on, or
    (`wanted`) stops the forward with the inputs the layer was given; the layer's attributes read through."""

    def __init__(self, layer: torch.nn.Module, wanted: bool) -> None:
        super().__init__()
        self.layer, self.wanted = layer, wanted

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.layer, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.wanted:
            raise StopForward(args, kwargs)
        return args[0] if args else kwargs["hidden_states"]


def capture_layer_inputs(
    decoder: torch.nn.Module,
    layers: torch.nn.ModuleList,
    index: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    observer: KVAbsmaxObserver,
) -> tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]]:
    """(hidden states (real for layer 0 only), args, kwargs) the decoder's forward passes to layer `index`: the
    decoder run with every layer a stand-in (no layer's weights needed), its cache showing K/V to `observer`."""
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _StandIn(layer, i == index)
    try:
        observed_forward(decoder, input_ids, attention_mask, observer.observe)
    except StopForward as captured:
        args, kwargs = captured.args[0], dict(captured.args[1])
    else:
        raise UnsupportedModelError(
            f"the decoder's forward never called decoder layer {index}",
            hint="calibrate this model without --stream-layers",
        )
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
    return (args[0], args[1:], kwargs) if args else (kwargs.pop("hidden_states"), (), kwargs)


class _Weights:
    """Loads one module's weights at a time, mapped and converted as `from_pretrained` does (renamings, MoE fusing)."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_dir: Path,
        files: CheckpointFiles,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model, self.model_dir, self.files = model, model_dir, files
        self.device, self.dtype = device, dtype
        # as from_pretrained dequantizes MXFP4 experts
        self.quantizer = internals.mxfp4_quantizer() if mxfp4.weights(files.key_files) else None
        meta = dict(model.state_dict())
        rename = internals.renamer(model, self.quantizer, meta)
        # model parameter -> the checkpoint keys it is made from
        self.sources: dict[str, list[str]] = {}
        for key in files.weight_map if files.weight_map is not None else files.key_files:
            self.sources.setdefault(rename(key), []).append(key)
        # checkpoint tensors the model has no place for
        self.unexpected = [k for name, ks in self.sources.items() if name not in meta for k in ks]

    def _under(self, prefix: str, skip: str | None) -> list[tuple[str, torch.Tensor]]:
        return [
            (name, tensor)
            for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]
            if name.startswith(prefix) and not (skip and name.startswith(skip))
        ]

    def check(self, prefix: str) -> None:
        """Every weight under `prefix` has a source in the checkpoint, and every tensor a place."""
        check_loading_info(self.model_dir, {"unexpected_keys": self.unexpected})
        for name, tensor in self._under(prefix, None):
            if tensor.device.type == "meta" and name not in self.sources:
                raise UnsupportedModelError(
                    f"{self.model_dir}: the model's weight {name} is not in the checkpoint's safetensors files",
                    hint="the checkpoint does not hold every weight this model's config describes; calibrate it "
                    "in memory (without --stream-layers) to see transformers' own report",
                )

    def load(self, prefix: str, skip: str | None = None) -> None:
        """Put the meta weights under `prefix` (except those under `skip`) on the device."""
        wanted = [
            name for name, tensor in self._under(prefix, skip) if tensor.device.type == "meta"
        ]
        # MXFP4 experts one weight at a time, each source pair dropped once converted: a layer's MXFP4 tensors are
        # never all in memory beside its dequantised experts (GPT-OSS-120B: 1.6 GB of them a layer)
        alone = [
            name
            for name in wanted
            if self.quantizer is not None
            and any(k.endswith(mxfp4.BLOCKS) for k in self.sources.get(name, []))
        ]
        self._convert([name for name in wanted if name not in alone], quantized=False)
        for name in alone:
            self._convert([name], quantized=True)
        for name, tensor in self._under(prefix, skip):
            if tensor.device != self.device:
                owner, _, attr = name.rpartition(".")
                holder = self.model.get_submodule(owner) if owner else self.model
                moved = tensor.to(self.device)
                setattr(
                    holder,
                    attr,
                    torch.nn.Parameter(moved, requires_grad=False)
                    if isinstance(tensor, torch.nn.Parameter)
                    else moved,
                )

    def _convert(self, names: list[str], quantized: bool) -> None:
        """Load the checkpoint tensors `names` are made from through transformers' conversion; `quantized`: MXFP4
        pairs with from_pretrained's quantizer, read as stored (uint8), not cast (GPT-OSS-120B: +2 GiB otherwise)."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            for key in self.sources.get(name, []):
                by_file.setdefault(str(self.files.file_of(key)), []).append(key)
        state: dict[str, torch.Tensor] = {}
        for file, keys in by_file.items():
            state.update(load_tensors(self.model_dir / file, keys))
        if not state:
            return
        with expert_chunks() if quantized else nullcontext():
            internals.load_state_dict(
                self.model,
                state,
                self.dtype,
                # afresh each time: a conversion collects the tensors it converts
                internals.conversion_mapping(self.model, self.quantizer),
                self.quantizer if quantized else None,
            )


class _Spilled(dict):
    """Each batch's hidden states between two layers, one safetensors file per batch in `folder`."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def __setitem__(self, b: int, hidden: torch.Tensor) -> None:
        save_file({"hidden": hidden.contiguous()}, Path(self.folder, f"batch-{b:06d}.safetensors"))

    def __getitem__(self, b: int) -> torch.Tensor:
        return load_file(Path(self.folder, f"batch-{b:06d}.safetensors"))["hidden"]
