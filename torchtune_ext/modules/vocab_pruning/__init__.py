"""Vocabulary pruning: fine-tune the token embedding and output projection over a subset of the vocabulary.

A Llama 3 model spends most of a small fine-tune's memory on its 128k-row embedding, its output projection and
the ``(batch, seq, vocab)`` logits. When the data only uses a few thousand token ids, :func:`prune_vocab_`
replaces both by copies of the ``K`` kept rows (in fp32 by default, while the rest of the model stays in its
compute dtype), remaps input ids and labels from the full vocabulary ``V`` to ``[0, K)``, and makes the model
produce logits over ``K``. :func:`export_full_vocab_state_dict` writes the trained rows back into the base
model's full-vocabulary tensors, giving a standard checkpoint.

Typical use::

    model.load_state_dict(base_state_dict)
    base_vocab = vocab_state_dict(base_state_dict)       # the base rows, to export into at the end
    kept_ids = collect_token_ids(dataset, always_keep=(tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id))
    pruning = prune_vocab_(model, kept_ids)              # fp32 copies of the kept rows
    logits = model(tokens)                               # tokens in the full vocabulary, logits over K
    loss = loss_fn(logits, pruning.remap_labels(labels))
    ...
    full_sd = export_full_vocab_state_dict(model.state_dict(), base_vocab, pruning.kept_ids)

Under FSDP2 the :class:`VocabPruning` module is one unit on its own (its ``forward`` embeds integer ids and
projects floating hidden states, so both uses go through FSDP's hooks)::

    fully_shard(pruning, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))

or it stays unsharded and replicated on every rank: keep it out of the root's ``fully_shard`` with
``ignored_params=set(pruning.parameters())`` and sum its gradients over the ranks after backward
(``torchtune_ext.distributed.all_reduce_grads``); ``torchtune_ext.distributed.shard_model`` does either.
"""

from torchtune_ext.modules.vocab_pruning._config import (
    VOCAB_PRUNING_KEYS,
    parse_vocab_pruning,
    resolve_kept_ids,
    scan_estimate_line,
)
from torchtune_ext.modules.vocab_pruning._kept_ids import (
    KEPT_IDS_FILENAME,
    ScanEstimate,
    collect_token_ids,
    estimate_scan_seconds,
    load_kept_ids,
    load_scanned_kept_ids,
    save_kept_ids,
    save_scanned_kept_ids,
    scan_kept_ids,
)
from torchtune_ext.modules.vocab_pruning._module import (
    PRUNED_OUTPUT_PREFIX,
    KeptIds,
    PrunedOutput,
    VocabPruning,
    validate_kept_ids,
)
from torchtune_ext.modules.vocab_pruning._state_dict import (
    export_full_vocab_state_dict,
    is_vocab_key,
    prune_state_dict,
    vocab_state_dict,
)
from torchtune_ext.modules.vocab_pruning._surgery import get_vocab_pruning, prune_vocab_

__all__ = [
    "KEPT_IDS_FILENAME",
    "VOCAB_PRUNING_KEYS",
    "ScanEstimate",
    "estimate_scan_seconds",
    "load_scanned_kept_ids",
    "parse_vocab_pruning",
    "resolve_kept_ids",
    "save_scanned_kept_ids",
    "scan_estimate_line",
    "scan_kept_ids",
    "PRUNED_OUTPUT_PREFIX",
    "KeptIds",
    "PrunedOutput",
    "VocabPruning",
    "collect_token_ids",
    "export_full_vocab_state_dict",
    "get_vocab_pruning",
    "is_vocab_key",
    "load_kept_ids",
    "prune_state_dict",
    "prune_vocab_",
    "save_kept_ids",
    "validate_kept_ids",
    "vocab_state_dict",
]
