"""Activation offloading in the estimate follows torchtune's streaming ``OffloadActivations``: what its
forward stash keeps on the device, and what its output-projection exclusion keeps off the host.

References: the estimate without offloading (what the device holds when nothing is offloaded) and the byte arithmetic
of the shapes. With activation checkpointing the offloaded tensors are, in the order they are saved, each layer's
input (``seq x dim``) and then the final RMSNorm's: its fp32 input twice and its fp32 row scales twice (the same two
storages, saved by two ops each); the step's peak is during the loss, where the forward stash is still held. Every
saved tensor takes an id, offloaded or not, and how many a checkpointed layer saves is torch's: measured here on a
real checkpointed call (:func:`_saves_per_checkpointed_layer`).
"""

import math
from functools import partial
from typing import Any, Callable

import pytest
import torch
from test_estimator import CE_CHUNKED, _cfg, _estimator
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtune_ext.memory import LiveStorageTracker, OffloadedActivations
from torchtune_ext.memory._offload import MAX_FWD_STASH_SIZE
from torchtune_ext.models import TINY_LLAMA_ARGS

NUM_LAYERS, SEQ_LEN, DIM = 8, 1024, TINY_LLAMA_ARGS["embed_dim"]
SETTINGS = [
    f"model.num_layers={NUM_LAYERS}",
    "model.lora_rank=4",
    f"model.max_seq_len={SEQ_LEN}",
    "dtype=bf16",
    "enable_activation_checkpointing=True",
]
LAYER_INPUT = SEQ_LEN * DIM * torch.bfloat16.itemsize
ROW_SCALES = 4096  # SEQ_LEN fp32 values, a multiple of the 512-byte rounding
NORM_INPUT = SEQ_LEN * DIM * 4  # fp32
FOR_MODEL = OffloadedActivations.for_model

pytestmark = pytest.mark.stack  # which tensors checkpointing saves is torch's (2.11 saves one more per layer)


def _offloaded_estimate(monkeypatch: pytest.MonkeyPatch, hooks: Callable[[nn.Module], Any], *settings: str):
    """The recipe's estimate with offloading, its hooks made by ``hooks(model)`` instead of ``for_model(model)``."""
    monkeypatch.setattr(OffloadedActivations, "for_model", hooks)
    return _estimator(_cfg(*SETTINGS, *settings, "enable_activation_offloading=True")).estimate(1, SEQ_LEN)


def _saves_per_checkpointed_layer() -> int:
    """How many tensors torch's non-reentrant checkpointing saves for a call on one input tensor, that input last:
    a real call under counting saved-tensor hooks (1, the input, on torch 2.13; 2 on torch 2.11, which first saves
    an empty placeholder)."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    x = torch.rand(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        checkpoint(torch.sin, x, use_reentrant=False)
    assert saved[-1] is x
    return len(saved)


def test_forward_stash_keeps_the_last_offloaded_tensors_on_the_device_through_the_loss(monkeypatch):
    """At the end of forward the stash holds the device copies of the offloaded tensors of the last ``window`` ids:
    the final norm's fp32 input (window 1), its row scales too (2 to 4), then one more layer input per ``per_layer``
    window steps (a checkpointed layer's saves take that many ids, its input the last), and every layer input from
    ``NUM_LAYERS * per_layer + 4`` on, where the device holds at the loss exactly what it holds without offloading.
    So the peak is no offloading's peak less the layer inputs and row scales released in forward."""
    no_offloading = _estimator(_cfg(*SETTINGS)).estimate(1, SEQ_LEN)
    assert MAX_FWD_STASH_SIZE == 5  # torchtune's default, which get_act_offloading_ctx_manager uses
    per_layer = _saves_per_checkpointed_layer()
    for window in sorted({1, 5, 6, 8, NUM_LAYERS * per_layer + 3, NUM_LAYERS * per_layer + 4}):
        estimate = _offloaded_estimate(monkeypatch, partial(FOR_MODEL, max_fwd_stash_size=window))
        layers_stashed = min(math.ceil(max(window - 4, 0) / per_layer), NUM_LAYERS)
        released = (NUM_LAYERS - layers_stashed) * LAYER_INPUT + (ROW_SCALES if window == 1 else 0)
        assert no_offloading.peak_bytes - estimate.peak_bytes == released, window
        assert estimate.phase == no_offloading.phase == "logits/loss"
        # Every offloaded tensor has its host copy, whatever the window (each pack its own).
        assert estimate.host_bytes == NUM_LAYERS * LAYER_INPUT + 2 * NORM_INPUT + 2 * ROW_SCALES


def test_output_projection_saved_tensors_stay_on_the_device(monkeypatch):
    """torchtune runs ``model.output`` under ``NoOpManager``: with an untied LoRA output projection called inside
    the model's forward (``CEWithChunkedOutputLoss``), what it saves (each chunk's input, the LoRA intermediates) is
    not offloaded, so the host holds only the layers' inputs and the final norm's tensors. Without the exclusion
    (the hooks alone) the chunks' saved tensors go to the host too."""
    qwen = [
        "model._component_=torchtune_ext.models.qlora_tiny_qwen",
        "model.tie_word_embeddings=False",
        "model.apply_lora_to_output=True",
        f"loss._component_={CE_CHUNKED}",
    ]
    offloaded = NUM_LAYERS * LAYER_INPUT + 2 * NORM_INPUT + 2 * ROW_SCALES
    assert _offloaded_estimate(monkeypatch, FOR_MODEL, *qwen).host_bytes == offloaded
    chunk_inputs = SEQ_LEN * DIM * torch.bfloat16.itemsize
    hooks_alone = _offloaded_estimate(monkeypatch, lambda model: OffloadedActivations(), *qwen)
    assert hooks_alone.host_bytes >= offloaded + chunk_inputs


def _sin_chain_backward_peak(numel: int, length: int) -> int:
    """The backward peak of ``x0 -> sin -> ... -> sin -> sum`` (``length`` sines, real fp32 CPU tensors), its
    saved inputs offloaded with a forward window of 1."""
    with LiveStorageTracker() as tracker:
        x = torch.rand(numel, requires_grad=True)
        with OffloadedActivations(max_fwd_stash_size=1):
            h = x
            for _ in range(length):
                h = torch.sin(h)
        loss = h.sum()
        del h
        loss.backward()
    return tracker.result().phase_peaks["backward"]


@pytest.mark.parametrize("length", [4, 6])
def test_backward_keeps_a_brought_back_tensor_until_the_next_node_has_run(length):
    """Each ``SinBackward`` node brings its input back (``B`` bytes) and computes ``grad * cos(input)``. A brought-
    back input stays until the next node that brings one back has run, so a middle node runs with ``x0``, the
    previous node's input, its own, the incoming gradient, ``cos`` and its result: 6 B, whatever the chain's length
    (released after its own node, it would be 5 B; kept on the device without offloading, ``length + 2`` B). The
    difference between two sizes cancels the scalars (the loss and its gradient)."""
    numel = 1 << 18
    nbytes = numel * 4
    assert _sin_chain_backward_peak(2 * numel, length) - _sin_chain_backward_peak(numel, length) == 6 * nbytes


def test_window_below_one_is_refused():
    with pytest.raises(ValueError, match="max_fwd_stash_size should be at least 1 but is 0"):
        OffloadedActivations(max_fwd_stash_size=0)
