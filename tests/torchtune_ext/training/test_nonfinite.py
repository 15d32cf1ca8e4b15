import math

import pytest
import torch

from torchtune_ext.config import UserFacingError
from torchtune_ext.training._nonfinite import NonFiniteError, NonFiniteGuard
from torchtune_ext.training._precision import LossScaler


@pytest.mark.parametrize(
    "clip_grad_norm, advice",
    [
        (
            None,
            "Try a lower optimizer.lr (e.g. 10x lower), a longer lr_scheduler.num_warmup_steps, or clip_grad_norm=1.",
        ),
        (
            10.0,
            "Try a lower optimizer.lr (e.g. 10x lower), a longer lr_scheduler.num_warmup_steps, or clip_grad_norm=1.",
        ),
        (
            1.0,
            "Try a lower optimizer.lr (e.g. 10x lower) or a longer lr_scheduler.num_warmup_steps (clip_grad_norm=1 "
            "already clips).",
        ),
        (
            0.5,
            "Try a lower optimizer.lr (e.g. 10x lower) or a longer lr_scheduler.num_warmup_steps (clip_grad_norm=0.5 "
            "already clips).",
        ),
    ],
)
def test_divergence_advice_suggests_clipping_only_where_it_would_clip_more(clip_grad_norm, advice):
    guard = NonFiniteGuard(LossScaler(enabled=False, device=torch.device("cpu")), clip_grad_norm)
    with pytest.raises(NonFiniteError) as raised:
        guard.check_step(3, math.nan, {"grad_norm": math.nan}, 1e-3, None)
    assert str(raised.value) == (
        "Training diverged at step 3 (lr 0.001): the loss is nan and the gradient norm nan. Stopped without saving; "
        f"no checkpoint of this run was written. {advice}"
    )
    assert isinstance(raised.value, UserFacingError) and raised.value.exit_code == 1  # one line, no traceback
