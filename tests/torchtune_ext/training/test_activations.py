"""Activation offloading: refused off CUDA at start-up; its logic on CPU, as far as a CPU can show it.

The offloading context (torchtune's ``OffloadActivations``) needs CUDA; what it acts on does not: it moves what the
saved-tensor hooks see. These tests run the QLoRA model under hooks that copy every tensor they would move to a
separate buffer (as a device-to-host copy would) and give the copy back in backward, and check that (1) with
activation checkpointing exactly the decoder layers' inputs are moved (torch's non-reentrant checkpoint saves them
through the hooks; the NF4 weights, the adapters and the layers' internal activations are not), and (2) the
gradients are those of the run without hooks. ``bench/gpu.sh`` runs the real context on a GPU.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torchtune import modules, training
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_ext.config import ConfigError
from torchtune_ext.models import qlora_tiny_llama
from torchtune_ext.training import activation_offloading, check_activation_offloading

SEQ, BATCH = 48, 2


def test_offloading_is_refused_off_cuda():
    check_activation_offloading(False, torch.device("cpu"))
    check_activation_offloading(True, torch.device("cuda"))
    with pytest.raises(ConfigError, match="enable_activation_offloading=True needs a CUDA device"):
        check_activation_offloading(True, torch.device("cpu"))
    assert isinstance(activation_offloading(torch.nn.Linear(2, 2), False), contextlib.nullcontext)


def _model(checkpointing: bool):
    model = qlora_tiny_llama(["q_proj", "v_proj"], apply_lora_to_mlp=True, dtype=torch.float32, device="cpu", seed=0)
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_b" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    set_trainable_params(model, get_adapter_params(model))
    if checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    return model


def _grads(model, hooks=None):
    tokens = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    context = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else torch.enable_grad()
    with context:
        logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _offloading_hooks(moved):
    """torchtune's rule (tensors of >= 1 KiB that are not parameters or buffers), as a copy out and back."""

    def pack(tensor):
        if tensor.numel() * tensor.element_size() < 1024 or isinstance(tensor, (torch.nn.Parameter, torch.nn.Buffer)):
            return tensor
        moved.append(tuple(tensor.shape))
        return ("moved", tensor.detach().clone())

    def unpack(packed):
        return packed[1].clone() if isinstance(packed, tuple) else packed

    return pack, unpack


def test_with_checkpointing_only_the_layer_inputs_move_and_gradients_are_unchanged():
    reference = _grads(_model(checkpointing=True))
    moved = []
    offloaded = _grads(_model(checkpointing=True), _offloading_hooks(moved))
    assert offloaded.keys() == reference.keys() and reference
    for name in reference:
        torch.testing.assert_close(offloaded[name], reference[name], rtol=0, atol=0, msg=name)
    layer_inputs = [shape for shape in moved if shape == (BATCH, SEQ, 256)]
    num_layers = len(_model(checkpointing=True).layers)
    # Each checkpointed layer's input (the residual stream), and around the layers only the final norm's and the
    # output projection's inputs: nothing of the layers' insides.
    assert len(layer_inputs) >= num_layers and len(moved) <= num_layers + 4, moved


def test_without_checkpointing_the_layer_activations_move_too():
    moved_with, moved_without = [], []
    _grads(_model(checkpointing=True), _offloading_hooks(moved_with))
    reference = _grads(_model(checkpointing=False))
    offloaded = _grads(_model(checkpointing=False), _offloading_hooks(moved_without))
    for name in reference:
        torch.testing.assert_close(offloaded[name], reference[name], rtol=0, atol=0, msg=name)
    assert len(moved_without) > 5 * len(moved_with)
