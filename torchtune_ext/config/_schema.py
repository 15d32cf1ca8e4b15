"""The recipes' config schemas: every key a recipe reads, declared once (:data:`RECIPE_SCHEMA` for the QLoRA recipes,
:data:`GENERATION_SCHEMA` for ``generate``, :data:`EVAL_SCHEMA` for ``eleuther_eval``: its type, default, allowed
values and one line of doc). The unknown-key checks (:data:`RECIPE_KEYS`, :data:`GENERATION_KEYS`,
:data:`EVAL_KEYS`), the range checks, the settings the recipes read (:func:`recipe_setting`,
``torchtune_ext.training.RecipeSettings``, ``torchtune_ext.generation.SamplingSettings``) and the key tables of
``docs/config-keys.md`` (:func:`key_tables`) all come from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from omegaconf import DictConfig

from torchtune_ext.config._errors import ConfigError, bad_value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Rule:
    """The values a key allows.

    Args:
        test (Callable[[Any], bool]): whether a value is allowed.
        what (str): the allowed values in words (``"a positive integer or null"``), for the error and the docs.
        problem (str): the error's problem; default ``"must be <what>"``.
        fix (str): the error's fix, where ``problem`` does not say it.
    """

    test: Callable[[Any], bool]
    what: str
    problem: str = ""
    fix: str = ""

    def error(self, key: str, value: Any) -> Optional[ConfigError]:
        """
        Args:
            key (str): the key, e.g. ``model.lora_rank``.
            value (Any): its value.

        Returns:
            Optional[ConfigError]: the error naming the key, the value and the fix; None where the value is allowed.
        """
        if self.test(value):
            return None
        return bad_value(key, value, self.problem or f"must be {self.what}", self.fix)


def positive_integer(nullable: bool) -> Rule:
    """
    Args:
        nullable (bool): whether null is allowed too.

    Returns:
        Rule: a positive integer (or null).
    """
    if nullable:
        return Rule(lambda v: v is None or _is_int(v) and v >= 1, "a positive integer or null")
    return Rule(lambda v: _is_int(v) and v >= 1, "a positive integer")


def _positive_number_or_null(what: str) -> Rule:
    return Rule(lambda v: v is None or _is_number(v) and v > 0, what)


#: a key's default where the config must set it (it has none).
REQUIRED = "required"
#: the default of a section's argument: its component's own.
COMPONENTS_OWN = "the component's"
#: the merge bases (``torchtune_ext.checkpoint.MERGE_BASES``).
MERGE_BASES = ("nf4", "original")


@dataclass(frozen=True)
class Key:
    """One key of a recipe's config.

    Args:
        name (str): the key; dotted for an argument of a section (``model.lora_rank``), checked when present.
        type (str): what the value is, in words: ``int``, ``float``, ``bool``, ``str``, ``component`` (a section
            with a ``_component_``), ``section`` (plain keys), ``list``.
        default (Any): its value when absent (:data:`REQUIRED`: none, the config sets it; :data:`COMPONENTS_OWN`: the
            component's default).
        doc (str): what it does, one line.
        rule (Optional[Rule]): the values it allows, checked at start-up; None: any of its type (or checked where it
            is read, e.g. the dtypes).
    """

    name: str
    type: str
    default: Any
    doc: str
    rule: Optional[Rule] = None


_COMPONENTS: Tuple[Key, ...] = (
    Key("model", "component", REQUIRED, "the QLoRA model builder and its arguments (LoRA rank, alpha, modules)"),
    Key("tokenizer", "component", REQUIRED, "the tokenizer builder, its files and `max_seq_len`"),
    Key("checkpointer", "component", REQUIRED, "the base checkpoint's folder, files and model type"),
    Key("dataset", "component", REQUIRED, "the training data set (a list of sections: their concatenation)"),
    Key("optimizer", "component", REQUIRED, "the optimizer (the recipe passes the trainable params)"),
    Key("lr_scheduler", "component", REQUIRED, "the learning-rate schedule (the recipe passes the step count)"),
    Key("loss", "component", REQUIRED, "the loss (`LinearCrossEntropyLoss`: chunked, no full logits)"),
    Key("metric_logger", "component", REQUIRED, "where the metrics go"),
    Key("dataset_val", "component", None, "the validation data set; null: no validation"),
    Key(
        "generate_base_checkpoint",
        "component",
        None,
        "writes a tiny base checkpoint into `checkpointer.checkpoint_dir` when it has none",
    ),
)
_RUN: Tuple[Key, ...] = (
    Key("output_dir", "str", REQUIRED, "the run's folder: checkpoints, recipe state, logs"),
    Key("overwrite_output_dir", "bool", False, "replace another run's checkpoints in `output_dir`"),
    Key("device", "str", REQUIRED, "the training device (`cpu`, `cuda`, `cuda:1`, `mps`, ...)"),
    Key("dtype", "str", "fp32", "the compute dtype: `fp32`, `bf16` or `fp16` (fp32 master adapters, loss scaling)"),
    Key("adapter_dtype", "str", None, "the LoRA/DoRA params' dtype; null: fp32 under fp16, else `dtype`"),
    Key(
        "frozen_dtype",
        "str",
        None,
        "the frozen embedding and output projection's dtype; null: the checkpoint's 16-bit one under fp32",
    ),
    Key("merged_dtype", "str", None, "the merged model's dtype; null: the base checkpoint's"),
    Key(
        "seed",
        "int",
        REQUIRED,
        "the seed of the data order, dropout and LoRA initialisation",
        Rule(lambda v: v is None or _is_int(v) and v >= 0, "an integer >= 0, or null (a random seed)"),
    ),
    Key("shuffle", "bool", REQUIRED, "shuffle the training data every epoch"),
    Key("cudnn_deterministic_mode", "bool", None, "torchtune's cuDNN determinism switch; null: left as it is"),
    Key("collate_fn", "str", "torchtune.data.padded_collate_sft", "the collate function's dotted path"),
    Key("batch_size", "int", 1, "samples per micro-batch, per rank", positive_integer(False)),
    Key(
        "global_batch_size",
        "int",
        None,
        "samples per micro-batch over all ranks (split over them); null: `batch_size` per rank",
        positive_integer(True),
    ),
    Key("gradient_accumulation_steps", "int", 1, "micro-batches per optimizer step", positive_integer(False)),
    Key(
        "clip_grad_norm",
        "float",
        None,
        "the gradient norm's limit",
        _positive_number_or_null("a number > 0, or null (no clipping)"),
    ),
    Key("epochs", "int", 1, "epochs to train", positive_integer(False)),
    Key(
        "max_steps_per_epoch",
        "int",
        None,
        "optimizer steps per epoch at most; null: the whole epoch",
        positive_integer(True),
    ),
    Key(
        "stop_after_step",
        "int",
        None,
        "end the run after this step, with a resumable checkpoint",
        positive_integer(True),
    ),
    Key("log_every_n_steps", "int", 1, "the metrics every that many steps", positive_integer(False)),
    Key(
        "save_every_n_steps",
        "int",
        None,
        "a resumable checkpoint every that many steps; null: at each epoch's end",
        positive_integer(True),
    ),
    Key(
        "run_val_every_n_steps",
        "int",
        None,
        "the validation loss every that many steps; null: no validation",
        positive_integer(True),
    ),
    Key("max_validation_steps", "int", None, "validation batches at most; null: all", positive_integer(True)),
    Key("resume_from_checkpoint", "bool", False, "continue the run saved in `output_dir`"),
    Key("save_adapter_weights_only", "bool", False, "never write the merged model"),
    Key(
        "merge_base",
        "str",
        "nf4",
        "what the adapter is merged onto",
        Rule(
            lambda v: v in MERGE_BASES,
            "`nf4` or `original`",
            "is not supported",
            "use merge_base=nf4 (merge onto the NF4 base the adapter was trained on: exactly the trained model) or "
            "merge_base=original (onto the checkpoint's own weights)",
        ),
    ),
    Key("merge_every_epoch", "bool", False, "a merged model at every epoch's end, not only the last"),
    Key("keep_last_n_checkpoints", "int", 2, "`step_N` folders kept, the newest; null: all"),
    Key("compile", "bool", False, "`torch.compile` the model and loss"),
    Key("enable_activation_checkpointing", "bool", False, "activation checkpointing per decoder layer"),
    Key("enable_activation_offloading", "bool", False, "saved activations in pinned host memory (CUDA)"),
    Key(
        "tiled_mlp_tokens",
        "int",
        None,
        "tokens per tile of the tiled MLPs; null: untiled",
        positive_integer(True),
    ),
    Key("loss_scaler", "section", None, "fp16 loss scaling: `LossScaler`'s arguments (`init_scale`, ...)"),
    Key(
        "vocab_pruning",
        "section",
        None,
        "train the token ids the data uses only (`enabled`, `kept_ids`, ...); null: off",
    ),
    Key(
        "log_peak_memory_stats",
        "bool",
        None,
        "torchtune's, accepted for configs shared with it (ours always log memory)",
    ),
)
_DRY_RUN: Tuple[Key, ...] = (
    Key("dry_run", "bool", False, "estimate the memory only: no weights or data are loaded"),
    Key(
        "device_profile", "str", None, "the card the config is for (a profile name): its memory and dtype limits apply"
    ),
    Key(
        "device_memory_gb",
        "float",
        None,
        "the card's memory, for the dry run; null: this device's",
        _positive_number_or_null("a number of GiB > 0, or null"),
    ),
    Key("compute_capability", "float", None, "with `device_memory_gb`: the card's compute capability (e.g. 7.5)"),
    Key(
        "host_memory_gb",
        "float",
        None,
        "the host's memory, for the dry run; null: this machine's",
        _positive_number_or_null("a number of GiB > 0, or null"),
    ),
    Key("memory_headroom", "float", 0.05, "the share of the device memory the dry run keeps free"),
    Key("world_size", "int", 2, "the ranks a dry run of the distributed recipe estimates for"),
)
_DISTRIBUTED: Tuple[Key, ...] = (
    Key("fsdp_cpu_offload", "bool", False, "FSDP2's parameter offload to host memory"),
    Key("fsdp_reshard_after_forward", "bool", True, "free the gathered parameters after each layer's forward"),
    Key("process_group_timeout_s", "int", 1800, "the collectives' timeout, in seconds"),
)
#: the attention projections torchtune's LoRA builders take (``torchtune.modules.peft.LORA_ATTN_MODULES``).
LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
#: arguments of the sections whose values are checked at start-up (the component takes the rest as it will).
_SECTION_ARGUMENTS: Tuple[Key, ...] = (
    Key(
        "model.lora_rank",
        "int",
        COMPONENTS_OWN,
        "the LoRA rank",
        Rule(lambda v: _is_int(v) and v >= 1, "an integer >= 1 (e.g. 8, 16, 64)"),
    ),
    Key(
        "model.lora_alpha",
        "float",
        COMPONENTS_OWN,
        "the LoRA scale's numerator (scale: alpha / rank)",
        Rule(lambda v: _is_number(v) and v > 0, "a number > 0 (commonly 2 * lora_rank)"),
    ),
    Key(
        "model.lora_dropout",
        "float",
        COMPONENTS_OWN,
        "dropout on the LoRA input",
        Rule(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ),
    Key(
        "model.lora_attn_modules",
        "list",
        COMPONENTS_OWN,
        f"the attention projections with LoRA: any of {list(LORA_ATTN_MODULES)}",
    ),
    Key(
        "optimizer.lr",
        "float",
        COMPONENTS_OWN,
        "the peak learning rate",
        Rule(lambda v: _is_number(v) and v > 0, "a number > 0 (e.g. 3e-4)"),
    ),
    Key(
        "optimizer.weight_decay",
        "float",
        COMPONENTS_OWN,
        "the optimizer's weight decay",
        Rule(lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    ),
    Key(
        "lr_scheduler.num_warmup_steps",
        "int",
        COMPONENTS_OWN,
        "steps of linear warm-up",
        Rule(lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    ),
    Key("loss.num_output_chunks", "int", COMPONENTS_OWN, "the loss's chunks of tokens", positive_integer(False)),
    Key(
        "tokenizer.max_seq_len",
        "int",
        None,
        "tokens per sample at most (longer ones are cut); the RoPE cache's length",
        positive_integer(True),
    ),
)
#: every key the QLoRA recipes read, each once (both recipes take the same keys; the distributed-only ones are
#: harmless on one device), then the section arguments checked at start-up. A key a recipe starts to read is added
#: here.
RECIPE_SCHEMA: Tuple[Key, ...] = (*_COMPONENTS, *_RUN, *_DRY_RUN, *_DISTRIBUTED, *_SECTION_ARGUMENTS)
#: sections that must be a ``_component_`` section, and those that may be null too.
REQUIRED_COMPONENTS = tuple(key.name for key in _COMPONENTS if key.default == REQUIRED)
OPTIONAL_COMPONENTS = tuple(key.name for key in _COMPONENTS if key.default != REQUIRED)

_TRAINED_MODEL: Tuple[Key, ...] = (
    Key("model", "component", REQUIRED, "the training config's model section: the adapter must fit it"),
    Key("tokenizer", "component", REQUIRED, "the tokenizer builder and its files, as in training"),
    Key(
        "checkpointer", "component", REQUIRED, "the base checkpoint's folder, files and model type (nothing is written)"
    ),
    Key("output_dir", "str", None, "the folder the config's `${output_dir}` names (the checkpointer's, unused)"),
    Key("adapter_dir", "str", None, "the PEFT adapter folder (a run's `step_N/adapter`); null: the base model alone"),
    Key("dtype", "str", "fp32", "the compute dtype: `fp32`, `bf16` or `fp16`"),
    Key("device", "str", REQUIRED, "the device (`cpu`, `cuda`, `cuda:1`, `mps`, ...)"),
)
#: every key the generate recipe reads (``torchtune_ext.generation.GenerationRecipe``), each once.
GENERATION_SCHEMA: Tuple[Key, ...] = (
    *_TRAINED_MODEL,
    Key("dry_run", "bool", False, "print the weights' and KV caches' memory at `max_seq_len`; loads nothing"),
    Key("mode", "str", "generate", "`generate`: answer the prompts; `chat`: a chat on the terminal (`tune-ext chat`)"),
    Key("prompt", "str or list", None, "a prompt or a list of them (e.g. from the command line); replaces `prompts`"),
    Key("prompts", "list", None, "the config's prompts (strings or chat messages)"),
    Key(
        "prompts_file",
        "str",
        None,
        'JSONL, one `{"prompt": ...}` or `{"messages": [...]}` per line; replaces `prompt` and `prompts`',
    ),
    Key("chat", "bool", True, "string prompts go through the tokenizer's chat template; false: raw text"),
    Key("answers_file", "str", None, "JSONL out: `prompt`, `answer`, `new_tokens`, `stop_reason` per prompt"),
    Key(
        "max_new_tokens",
        "int",
        128,
        "new tokens per answer at most",
        Rule(lambda v: _is_int(v) and v >= 1, "a positive integer", fix="e.g. 128"),
    ),
    Key(
        "temperature",
        "float",
        0.0,
        "0: greedy; else the logits are divided by it before sampling",
        Rule(lambda v: _is_number(v) and v >= 0, "a number >= 0", fix="0: greedy, e.g. 0.7: sampled"),
    ),
    Key(
        "top_k",
        "int",
        None,
        "sample among the `top_k` most likely tokens; null: all",
        Rule(lambda v: v is None or _is_int(v) and v >= 1, "a positive integer or null", fix="e.g. 50"),
    ),
    Key(
        "top_p",
        "float",
        None,
        "sample among the most likely tokens whose probabilities add up to `top_p`; null: all",
        Rule(
            lambda v: v is None or _is_number(v) and 0 < v <= 1,
            "a number in (0, 1], or null",
            "must be in (0, 1] or null",
            "e.g. 0.9",
        ),
    ),
    Key("seed", "int", None, "the sampling RNG's seed; null: nondeterministic"),
    Key("stop", "list", (), "strings that end an answer (it is cut before them), besides EOS"),
    Key("use_cache", "bool", True, "decode with KV caches; false: re-run the whole sequence per token"),
    Key(
        "max_seq_len",
        "int",
        None,
        "prompt + answer tokens at most (the KV caches' length); null: the model's",
        positive_integer(True),
    ),
)
#: every key the ``eleuther_eval`` recipe reads (``torchtune_ext.evaluation.EleutherEvalRecipe``), each once.
EVAL_SCHEMA: Tuple[Key, ...] = (
    *_TRAINED_MODEL,
    Key(
        "merged_dir",
        "str",
        None,
        "a merged HF folder, evaluated in `dtype` (`model`, `checkpointer`, `adapter_dir` then unused)",
    ),
    Key("tasks", "list", REQUIRED, "lm-eval task names, groups or tags (or task YAML files)"),
    Key("include_path", "str", None, "a folder of local lm-eval task YAMLs"),
    Key("num_fewshot", "int", None, "few-shot examples per prompt; null: each task's own"),
    Key("limit", "float", None, "documents per task at most (below 1: that share of them); null: all"),
    Key("batch_size", "int", REQUIRED, "requests per forward", positive_integer(False)),
    Key(
        "max_seq_len", "int", REQUIRED, "tokens per request at most (and the model's at most)", positive_integer(False)
    ),
    Key("output_file", "str", None, "lm-eval's results JSON, with every sample's scores; null: none"),
    Key("bootstrap_iters", "int", 0, "lm-eval's bootstrap resamples for the metrics' standard errors; 0: none"),
    Key("seed", "int", 1234, "the seed of torch, Python, NumPy and lm-eval's few-shot sampling"),
)


def _top_level(schema: Sequence[Key]) -> frozenset:
    return frozenset(key.name for key in schema if "." not in key.name)


#: the top-level keys of :data:`RECIPE_SCHEMA`: any other is an unknown key.
RECIPE_KEYS = _top_level(RECIPE_SCHEMA)
#: the top-level keys of :data:`GENERATION_SCHEMA` and :data:`EVAL_SCHEMA`.
GENERATION_KEYS = _top_level(GENERATION_SCHEMA)
EVAL_KEYS = _top_level(EVAL_SCHEMA)
#: each recipe's schema, as ``docs/config-keys.md`` lists them: the recipes it serves, the schema.
SCHEMAS: Tuple[Tuple[Tuple[str, ...], Tuple[Key, ...]], ...] = (
    (("qlora_finetune_single_device", "qlora_finetune_distributed"), RECIPE_SCHEMA),
    (("generate",), GENERATION_SCHEMA),
    (("eleuther_eval",), EVAL_SCHEMA),
)


def lookup(cfg: DictConfig, dotted: str) -> Tuple[bool, Any]:
    """
    Args:
        cfg (DictConfig): the config.
        dotted (str): a key, dotted for a section's argument.

    Returns:
        Tuple[bool, Any]: whether the config sets it, and its value (None where it does not).
    """
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False, None
        node = node[part]
    return True, node


def declared(key: str, schema: Sequence[Key] = RECIPE_SCHEMA) -> Key:
    """
    Args:
        key (str): a key, dotted for a section's argument.
        schema (Sequence[Key]): its recipe's schema (:data:`RECIPE_SCHEMA`, :data:`GENERATION_SCHEMA`,
            :data:`EVAL_SCHEMA`).

    Returns:
        Key: its declaration.

    Raises:
        KeyError: if ``schema`` does not declare it.
    """
    for spec in schema:
        if spec.name == key:
            return spec
    raise KeyError(f"{key} is not declared in the schema: declare it in torchtune_ext/config/_schema.py")


def check_setting(key: str, value: Any, schema: Sequence[Key] = RECIPE_SCHEMA) -> Any:
    """
    Args:
        key (str): a key of ``schema``.
        value (Any): a value of it (from a config, or given to a class that takes the setting).
        schema (Sequence[Key]): its recipe's schema.

    Returns:
        Any: ``value``.

    Raises:
        ConfigError: if the key's rule does not allow the value, naming the key, the value and the fix.
    """
    rule = declared(key, schema).rule
    error = rule.error(key, value) if rule is not None else None
    if error is not None:
        raise error
    return value


def recipe_setting(cfg: DictConfig, key: str, schema: Sequence[Key] = RECIPE_SCHEMA) -> Any:
    """A key as its recipe reads it: the config's value, else the key's default.

    Args:
        cfg (DictConfig): the recipe config.
        key (str): the key, e.g. ``epochs`` or ``tokenizer.max_seq_len``.
        schema (Sequence[Key]): the recipe's schema: :data:`RECIPE_SCHEMA` (the QLoRA recipes'),
            :data:`GENERATION_SCHEMA` or :data:`EVAL_SCHEMA`.

    Returns:
        Any: the value.

    Raises:
        ConfigError: if the value is not one the key allows, or the config lacks a key it must set.
    """
    spec = declared(key, schema)
    present, value = lookup(cfg, key)
    if not present and spec.default == COMPONENTS_OWN:
        raise ValueError(f"{key} is an argument of a component, read by the component itself")
    if not present:
        if spec.default == REQUIRED:
            raise ConfigError(f"{key} is missing: the recipe needs it ({spec.doc}); set {key}=...", key)
        return spec.default
    return check_setting(key, value, schema)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def key_table(schema: Sequence[Key] = RECIPE_SCHEMA) -> str:
    """
    Args:
        schema (Sequence[Key]): a recipe's schema.

    Returns:
        str: the schema as a Markdown table (key, type, default, allowed values, what it does).
    """
    rows = ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for key in schema:
        default = key.default if key.default in (REQUIRED, COMPONENTS_OWN) else f"`{key.default}`"
        default = "null" if key.default is None else default
        allowed = key.rule.what if key.rule is not None else ""
        rows.append(f"| `{key.name}` | {key.type} | {default} | {_cell(allowed)} | {_cell(key.doc)} |")
    return "\n".join(rows) + "\n"


def key_tables() -> str:
    """
    Returns:
        str: each recipe's key table under a heading naming its recipes (:data:`SCHEMAS`): the generated part of
        ``docs/config-keys.md``.
    """
    headings = [", ".join(f"`{name}`" for name in recipes) for recipes, _ in SCHEMAS]
    return "\n".join(f"## {heading}\n\n{key_table(schema)}" for heading, (_, schema) in zip(headings, SCHEMAS))
