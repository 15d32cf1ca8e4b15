"""Helpers for the tests ported from torchtune v0.6.1 (commit a6290a5b40758f13bca61c386bc8756a49ef417e).

Copied, unchanged in behaviour (only reformatted):

- ``fixed_init_tensor``, ``fixed_init_model``, ``assert_expected``: from torchtune's ``tests/test_utils.py`` at
  v0.6.1.
- ``MLP``: from PyTorch's ``torch/testing/_internal/common_fsdp.py`` (torch 2.13), used by torchtune's
  ``tests/torchtune/training/test_distributed.py``; copied because that module imports ``expecttest``, which the
  project's venv does not have.

Written here:

- ``assert_equal``: a stand-in for ``torch.testing._internal.common_utils.TestCase.assertEqual`` (upstream's FSDP
  tests are ``unittest`` classes; the same module needs ``expecttest``): tensors are compared with
  ``torch.testing.assert_close`` and its default dtype-based tolerances (the defaults ``assertEqual`` uses too),
  with ``equal_nan=True`` and without checking the device, as ``assertEqual`` does; containers recursively.
- ``expect_gap`` / ``xfail_gap``: a strict xfail that only counts the *known* failure (used by the one documented
  difference left, the DoRA bias in ``test_dora.py``). ``expect_gap(pattern)`` turns an exception whose text
  matches ``pattern`` into a ``ContractGap``; ``xfail_gap`` is ``pytest.mark.xfail(strict=True,
  raises=ContractGap)``. A test failing for any other reason is reported as a failure, and one that passes is an
  XPASS(strict) failure.
- ``register_distributed_cases`` / ``check_distributed_case``: the multi-process tests of every ported file run in
  *one* 2-process gloo job (``run_distributed`` from ``tests/conftest.py``; one spawn costs ~10-20 s of the suite's
  budget on 2 cores). Each test file registers its cases (module-level functions ``fn(rank, *args)``) at import;
  the first test that asks for an outcome runs every case registered so far, in order, with a barrier after each
  (a failed case leaves no collective behind), and records each rank's traceback.
- ``use_our_lora_layers_``: swaps torchtune's ``LoRALinear``/``DoRALinear`` in a torchtune-built model for ours
  (unquantized), for the upstream model tests that use LoRA without NF4.
"""

import json
import math
import os
import re
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import run_distributed
from torch import nn
from torchtune.modules.peft import DoRALinear as TorchtuneDoRALinear
from torchtune.modules.peft import LoRALinear as TorchtuneLoRALinear

from torchtune_ext.modules import DoRALinear, LoRALinear

# ---- copied from torchtune v0.6.1 tests/test_utils.py ----------------------------------------------------------


def fixed_init_tensor(
    shape: torch.Size,
    min_val: Union[float, int] = 0.0,
    max_val: Union[float, int] = 1.0,
    nonlinear: bool = False,
    dtype: torch.dtype = torch.float,
):
    """
    Utility for generating deterministic tensors of a given shape. In general stuff
    like torch.ones, torch.eye, etc can result in trivial outputs. This utility
    generates a range tensor [min_val, max_val) of a specified dtype, applies
    a sine function if nonlinear=True, then reshapes to the appropriate shape.
    """
    n_elements = math.prod(shape)
    step_size = (max_val - min_val) / n_elements
    x = torch.arange(min_val, max_val, step_size, dtype=dtype)
    x = x.reshape(shape)
    if nonlinear:
        return torch.sin(x)
    return x


@torch.no_grad
def fixed_init_model(
    model: nn.Module,
    min_val: Union[float, int] = 0.0,
    max_val: Union[float, int] = 1.0,
    nonlinear: bool = False,
    dtype: Optional[torch.dtype] = None,
):
    """
    This utility initializes all parameters of a model deterministically using the
    function fixed_init_tensor above. See that docstring for details of each parameter.
    """
    for _, param in model.named_parameters():
        param.copy_(
            fixed_init_tensor(
                param.shape,
                min_val=min_val,
                max_val=max_val,
                nonlinear=nonlinear,
                dtype=param.dtype if dtype is None else dtype,
            )
        )


def assert_expected(
    actual: Any,
    expected: Any,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    check_device: bool = True,
):
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rtol,
        atol=atol,
        check_device=check_device,
        msg=f"actual: {actual}, expected: {expected}",
    )


# ---- copied from torch 2.13 torch/testing/_internal/common_fsdp.py -----------------------------------------------


class MLP(nn.Module):
    def __init__(
        self,
        dim: int,
        device: Optional[torch.device] = None,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, device=device, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, device=device, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,), device=device))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.in_proj(x)
        z = F.relu(z)
        z = self.out_proj(z)
        z = F.relu(z)
        if self.buffer is not None:
            z = z + self.buffer
        return z

    def reset_parameters(self):
        if self.buffer is not None:
            torch.nn.init.normal_(self.buffer)


# ---- written for the port -------------------------------------------------------------------------------------------


def assert_equal(actual: Any, expected: Any, path: str = "") -> None:
    """``TestCase.assertEqual`` for what upstream compares: tensors, numbers, mappings, sequences, other values."""
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        torch.testing.assert_close(
            actual, expected, equal_nan=True, check_device=False, msg=lambda m: f"{path}: {m}" if path else m
        )
    elif isinstance(actual, dict) and isinstance(expected, dict):
        assert set(actual.keys()) == set(expected.keys()), f"{path}: keys differ"
        for key in actual:
            assert_equal(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_equal(a, e, f"{path}[{i}]")
    elif isinstance(actual, float) and isinstance(expected, (int, float)):
        torch.testing.assert_close(actual, float(expected), msg=lambda m: f"{path}: {m}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


class ContractGap(AssertionError):
    """The known, documented failure of an upstream test on our layers (see ``expect_gap``)."""


@contextmanager
def expect_gap(pattern: str) -> Iterator[None]:
    """Re-raises an exception whose ``"TypeName: message"`` text matches ``pattern`` as a ``ContractGap``."""
    try:
        yield
    except ContractGap:
        raise
    except BaseException as e:  # noqa: BLE001 - any failure is classified, the unknown ones re-raised as they are
        text = f"{type(e).__name__}: {e}"
        if re.search(pattern, text, flags=re.DOTALL):
            raise ContractGap(f"known contract gap (matched {pattern!r}):\n{text}") from e
        raise


def xfail_gap(reason: str) -> pytest.MarkDecorator:
    """Strict xfail that accepts only a ``ContractGap`` (raised by ``expect_gap``)."""
    return pytest.mark.xfail(strict=True, raises=ContractGap, reason=reason)


def use_our_lora_layers_(model: nn.Module) -> nn.Module:
    """Replaces every torchtune ``LoRALinear``/``DoRALinear`` in ``model`` by ours (``quantize_base=False``, no
    explicit dtype: the base in torch's default dtype, computing in the input's dtype, as torchtune's layer)."""
    replacements = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, (TorchtuneLoRALinear, TorchtuneDoRALinear)):
                replacements.append((parent, name, child))
    for parent, name, child in replacements:
        assert not child._quantize_base, "use our QLoRA builders (build_qlora) for quantized bases"
        cls = DoRALinear if isinstance(child, TorchtuneDoRALinear) else LoRALinear
        rank = child.lora_a.out_features
        # torchtune's LoRALinear keeps ``alpha``; its DoRALinear only ``scaling`` (= alpha / rank)
        alpha = child.alpha if hasattr(child, "alpha") else child.scaling * rank
        ours = cls(
            child.in_dim,
            child.out_dim,
            rank=rank,
            alpha=alpha,
            dropout=child.dropout.p if isinstance(child.dropout, nn.Dropout) else 0.0,
            use_bias=child.use_bias,
            quantize_base=False,
        )
        ours.to(device=child.weight.device, dtype=child.weight.dtype)
        setattr(parent, name, ours)
    return model


WORLD_SIZE = 2
_REGISTERED: Dict[str, Tuple[Callable, tuple]] = {}
_OUTCOMES: Dict[str, List[Optional[str]]] = {}


def register_distributed_cases(cases: Dict[str, Tuple[Callable, tuple]]) -> None:
    """Registers ``{name: (fn, args)}``; ``fn(rank, *args)`` must be a module-level function (it is pickled)."""
    for name in cases:
        assert name not in _REGISTERED, f"distributed case {name} registered twice"
    _REGISTERED.update(cases)


def _run_cases(rank: int, world_size: int, cases: List[Tuple[str, Callable, tuple]], out_dir: str) -> None:
    outcomes = {}
    for name, fn, args in cases:
        try:
            fn(rank, *args)
            outcomes[name] = None
        except Exception:
            outcomes[name] = traceback.format_exc()
        dist.barrier()  # a failed case must not leave collectives behind for the next one
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcomes, f)


def check_distributed_case(name: str, tmp_path_factory) -> None:
    """Fails with every rank's traceback if case ``name`` failed (runs the pending cases first)."""
    if name not in _OUTCOMES:
        pending = [(n, fn, args) for n, (fn, args) in _REGISTERED.items() if n not in _OUTCOMES]
        out_dir = str(tmp_path_factory.mktemp("upstream_distributed"))
        run_distributed(_run_cases, WORLD_SIZE, pending, out_dir)
        per_rank = []
        for rank in range(WORLD_SIZE):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
        for n, _, _ in pending:
            _OUTCOMES[n] = [outcomes[n] for outcomes in per_rank]
    failures = [f"--- rank {rank} ---\n{tb}" for rank, tb in enumerate(_OUTCOMES[name]) if tb is not None]
    assert not failures, "\n".join(failures)
