"""The out-of-memory message's release of the failed step: what a notebook keeps (the last exception) no longer
holds the step's tensors, nor, on torch < 2.12, the saved-tensor hooks of the checkpointed layer it failed in."""

import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torchtune_ext.training._oom import release_frames


def _saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@pytest.mark.stack
def test_release_frames_frees_the_failed_forward_and_ends_its_checkpoint():
    alive = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        activation = x * 2
        alive.append(weakref.ref(activation))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        checkpoint(layer, torch.ones(4, requires_grad=True), use_reentrant=False)
    except torch.OutOfMemoryError as caught:
        error = caught  # kept, as a notebook keeps sys.last_value
    assert alive[0]() is not None  # held by the failed frame (torch 2.10/2.11: and the checkpoint's hooks stay on)

    release_frames(error)

    assert alive[0]() is None
    assert not _saved_tensor_hooks_active()
    x = torch.ones(3, requires_grad=True)  # the next run's autograd saves and computes as usual
    (x * x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
