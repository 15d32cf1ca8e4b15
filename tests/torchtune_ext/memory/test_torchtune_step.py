"""torchtune's ``lora_finetune_single_device`` step with its activation offloading and packed batches
(``TorchtuneStep``), against torchtune's own packing and collation and hand computations over a tiny QLoRA Llama 3.

Reference shapes: batch B x S tokens, LAYERS decoder layers of HEADS heads of HEAD_DIM (DIM = HEADS * HEAD_DIM), bf16;
LoRA on q/v only, so the first layer's k (from the frozen embedding, no adapter) needs no gradient.
"""

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch.torch_version import TorchVersion
from torchtune import training
from torchtune.data import padded_collate_packed
from torchtune.datasets import PackedDataset
from torchtune.models.llama3 import lora_llama3

from torchtune_ext.memory import (
    LiveStorageTracker,
    MemoryEstimator,
    TorchtuneStep,
    adamw_factory,
    flex_or_sdpa_attention,
    packed_batch,
)

B, S, LAYERS, HEADS, HEAD_DIM = 2, 256, 2, 4, 64
DIM = HEADS * HEAD_DIM
BLOCKS = S // 128  # flex attention's default sparse block size
ROUND = 512  # the CUDA caching allocator's granularity, as the tracker counts
# torch < 2.11 hands flex attention's backward zero gradients for its fp32 statistics (logsumexp and max scores, each
# B x HEADS x S), materialized (2.11 on: ``set_materialize_grads(False)``, None); the estimate counts what runs: both
# in eager, logsumexp's alone in a compiled graph (measured on torch 2.10).
STAT_GRADS_EAGER, STAT_GRADS_COMPILED = (2, 1) if TorchVersion(torch.__version__) < "2.11" else (0, 0)

pytestmark = pytest.mark.stack  # checkpointing, flex attention's BlockMask, AOTAutograd: torch's, per version


def _model():
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
        return lora_llama3(
            lora_attn_modules=["q_proj", "v_proj"],
            vocab_size=1024,
            num_layers=LAYERS,
            num_heads=HEADS,
            num_kv_heads=2,
            embed_dim=DIM,
            max_seq_len=512,
            intermediate_dim=512,
            lora_rank=8,
            lora_alpha=16,
            quantize_base=True,
        )


def _estimate(step: TorchtuneStep, checkpointing: bool, compile: bool = False):
    from torchtune_ext.memory import compiled_setup

    setup = compiled_setup(step.setup) if compile else step.setup
    estimator = MemoryEstimator(
        _model(),
        train_step=step,
        setup=setup,
        activation_checkpointing=checkpointing,
        optimizer_factory=adamw_factory(trainable_only=False),
    )
    return estimator.estimate(B, S)


def test_packed_batch_is_what_torchtune_packs_and_collates():
    """Positions and mask of ``packed_batch`` against torchtune's ``PackedDataset`` + ``padded_collate_packed`` on
    this CPU (its dense block-causal mask, SDPA's); the ``BlockMask``'s tensors against their shapes by hand."""
    packs = PackedDataset([{"tokens": [1] * S, "labels": [1] * S}] * B, max_seq_len=S)
    reference = padded_collate_packed([packs[i] for i in range(B)])
    batch = packed_batch(B, S, torch.device("cpu"))
    assert torch.equal(batch["input_pos"], reference["input_pos"])
    positions = torch.arange(S)
    mask = batch["mask"]
    dense = torch.stack([mask.mask_mod(torch.tensor(b), 0, positions[:, None], positions[None, :]) for b in range(B)])
    assert torch.equal(dense, reference["mask"])
    assert reference["mask"].numel() * reference["mask"].element_size() == B * S * S  # SDPA's path: b*s*s bytes
    tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
    # (kv, full kv, q, full q) x (num_blocks [B, 1, BLOCKS], indices [B, 1, BLOCKS, BLOCKS]), int32
    assert sorted(t.numel() * t.element_size() for t in tensors) == sorted(
        [B * BLOCKS * 4] * 4 + [B * BLOCKS * BLOCKS * 4] * 4
    )


def test_flex_attention_counts_its_outputs_and_backward_workspace():
    """Flex attention on fake tensors under the tracker: its forward's output and fp32 logsumexp and max scores,
    its backward's dQ/dK/dV and the fp32 ``delta`` inductor's backward computes (a spike at the op)."""
    q_bytes, row_bytes = B * HEADS * S * HEAD_DIM * 2, B * HEADS * S * 4
    with FakeTensorMode():
        q, k, v = (torch.empty(B, HEADS, S, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mask = packed_batch(B, S, torch.device("cpu"))["mask"]
        tracker = LiveStorageTracker()
        with tracker:
            out = flex_or_sdpa_attention(q, k, v, mask, 0.0, False)
            out.backward(torch.empty_like(out))
    result = tracker.result()
    # Live at the end of the backward op: out, its gradient, logsumexp and max scores (saved), dQ/dK/dV, the
    # delta; and 6 zero-dim tensors the eager op's autograd makes to trace its score function (one block each;
    # the compiled kernel on a GPU has none).
    stat_grads = STAT_GRADS_EAGER * row_bytes
    assert result.peak_bytes == 2 * q_bytes + 2 * row_bytes + 3 * q_bytes + row_bytes + 6 * ROUND + stat_grads


def test_packed_estimate_differs_from_padded_only_by_mask_positions_and_kernel():
    """Eager, no checkpointing: at the peak (the loss) the packed step holds, besides the padded one's:
    ``input_pos`` and the mask's document ids (int64, B x S each), the ``BlockMask``'s 8 tensors (one block each),
    per layer flex attention's saved fp32 max scores (B x HEADS x S) and its autograd's 6 zero-dim tensors, and
    the RoPE cos/sin rows gathered at ``input_pos`` (fp32, B x S x HEAD_DIM) that the rotations of q and k save
    (the padded step's are views of the cache), but for the first layer's k, which needs no gradient."""
    padded = _estimate(TorchtuneStep(), checkpointing=False)
    packed = _estimate(TorchtuneStep(packed=True), checkpointing=False)
    assert packed.phase == padded.phase == "logits/loss"
    rope_rows = B * S * HEAD_DIM * 4
    expected = 2 * B * S * 8 + 8 * ROUND + LAYERS * (B * HEADS * S * 4 + 6 * ROUND) + (2 * LAYERS - 1) * rope_rows
    assert packed.peak_bytes - padded.peak_bytes == expected


@pytest.mark.slow
def test_compiled_packed_estimate_differs_from_padded_by_the_batch_and_the_kernel():
    """Compiled, with checkpointing (each layer's forward and backward one graph, flex attention an extern kernel):
    the partition recomputes the RoPE rows and keeps no max scores, and the peak is in a layer's attention backward,
    so what differs is the batch (``input_pos``, the document ids, the ``BlockMask``'s 8 tensors) and the backward
    kernel's workspace: flex attention's fp32 delta (B x HEADS x S) instead of FlashAttention-2's fp32 dQ
    accumulator and row sums (sequence rounded to 128, head dim to 32)."""
    padded = _estimate(TorchtuneStep(), checkpointing=True, compile=True)
    packed = _estimate(TorchtuneStep(packed=True), checkpointing=True, compile=True)
    flash = 4 * B * S * HEADS * HEAD_DIM + 4 * B * HEADS * S  # S = 256 and HEAD_DIM = 64 are multiples already
    flex = 4 * B * HEADS * S * (1 + STAT_GRADS_COMPILED)
    assert packed.peak_bytes - padded.peak_bytes == 2 * B * S * 8 + 8 * ROUND + flex - flash


def test_activation_offloading_moves_the_layer_inputs_to_the_host_but_not_the_output_head():
    """With checkpointing, torchtune's offloading moves what its checkpointed layers save (each layer's input, bf16
    B x S x DIM) and what the final norm saves (its fp32 input, saved by the pow and the multiply, and its fp32 rsqrt
    row, by the rsqrt and the multiply: each save copied on its own), and nothing of the output projection's
    (its NF4 weight, per chunk), which it runs under its ``NoOpManager``."""
    plain = _estimate(TorchtuneStep(), checkpointing=True)
    offloaded = _estimate(TorchtuneStep(activation_offloading=True), checkpointing=True)
    assert plain.host_bytes == 0
    assert offloaded.host_bytes == LAYERS * B * S * DIM * 2 + 2 * B * S * DIM * 4 + 2 * B * S * 4
