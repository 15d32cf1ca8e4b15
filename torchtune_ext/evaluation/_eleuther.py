"""The ``eleuther_eval`` recipe's logic: the model (as it trained, or merged) behind lm-eval's ``TemplateLM``
(``_lm.TorchtuneLM``). The package imports without lm-eval; the recipe says how to install it before any load."""

from __future__ import annotations

import difflib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchtune import training, utils
from torchtune.training import FullModelHFCheckpointer

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.checkpoint import read_hf_config
from torchtune_ext.config import (
    EVAL_KEYS,
    EVAL_SCHEMA,
    ConfigError,
    ConfigFileNotFoundError,
    check_generation_config,
    instantiate_component,
    recipe_setting,
)
from torchtune_ext.generation import load_model_with_adapter
from torchtune_ext.models import torchtune_builder_for
from torchtune_ext.training import build_tokenizer


def _torchtune_lm_class() -> type:
    """:class:`~torchtune_ext.evaluation._lm.TorchtuneLM`, or a MissingExtraError that says how to install lm-eval."""
    from torchtune_ext.evaluation._lm import TorchtuneLM

    return TorchtuneLM


def load_merged_model(merged_dir: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A merged HF folder (e.g. ``tune-ext merge``'s output) as a plain torchtune decoder, in ``dtype``.

    Args:
        merged_dir (str): the folder (``config.json`` + safetensors).
        dtype (torch.dtype): the weights' and compute dtype.
        device (torch.device): where the model goes.

    Returns:
        nn.Module: the model in eval mode, no gradients.

    Raises:
        ConfigFileNotFoundError: if the folder has no ``config.json`` or no safetensors file.
    """
    folder = Path(merged_dir)
    hf_config = read_hf_config(folder, "merged_dir")
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ConfigFileNotFoundError(
            f"merged_dir={merged_dir}: no *.safetensors file there; give a merged HF folder.", "merged_dir"
        )
    lora_builder, args, model_type = torchtune_builder_for(hf_config)
    # the plain builder beside torchtune's lora_* one (lora_llama3_2 -> llama3_2), with the same arguments
    builder = getattr(sys.modules[lora_builder.__module__], lora_builder.__name__.removeprefix("lora_"))
    checkpointer = FullModelHFCheckpointer(str(folder), files, model_type, output_dir=tempfile.gettempdir())  # unused
    state = checkpointer.load_checkpoint()[training.MODEL_KEY]
    with training.set_default_dtype(dtype), device:
        model = builder(**args)
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


class EleutherEvalRecipe:
    """lm-eval tasks on the model as it trained or on a merged folder; settings are checked before any load.

    Config keys: those of ``torchtune_ext.config.EVAL_SCHEMA`` (their types, defaults and allowed values:
    ``docs/config-keys.md``): the model as it trained (``model``, ``tokenizer``, ``checkpointer``, ``adapter_dir``:
    the base streamed into NF4 + the adapter) or ``merged_dir`` (a merged HF folder, loaded in ``dtype``).

    Args:
        cfg (DictConfig): the config.

    Raises:
        ConfigError: on an unknown key, a device that is not there, an empty task list, a task lm-eval does not know
            (with ``include_path``), or a bad ``batch_size`` / ``max_seq_len``, naming the key
            (``ConfigFileNotFoundError``: a missing ``include_path`` or ``merged_dir``).
        MissingExtraError: when lm-eval (the ``eval`` extra) is not installed, with the command that installs it.
    """

    def __init__(self, cfg: DictConfig):
        check_generation_config(cfg, EVAL_KEYS)  # unknown keys, a device that is not there
        self._device = utils.get_device(device=recipe_setting(cfg, "device", EVAL_SCHEMA))
        self._dtype = parse_dtype(recipe_setting(cfg, "dtype", EVAL_SCHEMA), self._device)
        tasks = recipe_setting(cfg, "tasks", EVAL_SCHEMA)
        self.tasks = list(tasks) if isinstance(tasks, (list, ListConfig)) else ([tasks] if tasks else [])
        if not self.tasks:
            raise ConfigError("tasks is empty: name lm-eval tasks, e.g. tasks=[arc_easy,hellaswag].", "tasks")
        self._batch_size = recipe_setting(cfg, "batch_size", EVAL_SCHEMA)
        self._max_seq_len = recipe_setting(cfg, "max_seq_len", EVAL_SCHEMA)
        self._include_path = recipe_setting(cfg, "include_path", EVAL_SCHEMA)
        self._merged_dir = recipe_setting(cfg, "merged_dir", EVAL_SCHEMA)
        for key, path in (("include_path", self._include_path), ("merged_dir", self._merged_dir)):
            if path is not None and not Path(path).is_dir():
                raise ConfigFileNotFoundError(f"{key}={path} is not a folder.", key)
        self._output_file = recipe_setting(cfg, "output_file", EVAL_SCHEMA)
        self._lm_class = _torchtune_lm_class()
        self._task_manager = _task_manager(self.tasks, self._include_path)
        self._seed = recipe_setting(cfg, "seed", EVAL_SCHEMA)
        training.set_seed(seed=self._seed)

    def setup(self, cfg: DictConfig) -> None:
        """Loads the tokenizer and the model (merged, or the base into NF4 + the adapter, checked first)."""
        start = time.perf_counter()
        tokenizer = build_tokenizer(cfg.tokenizer)
        if self._merged_dir is not None:
            model, what = load_merged_model(self._merged_dir, self._dtype, self._device), self._merged_dir
        else:
            checkpointer = instantiate_component(cfg.checkpointer, "checkpointer")
            adapter_dir = recipe_setting(cfg, "adapter_dir", EVAL_SCHEMA)
            model = load_model_with_adapter(
                checkpointer, adapter_dir, model=cfg.model, dtype=self._dtype, device=self._device
            )
            what = f"{checkpointer.checkpoint_dir} into NF4 + adapter {adapter_dir}"
        max_seq_len = min(self._max_seq_len, model.max_seq_len)
        self.lm = self._lm_class(model, tokenizer, self._dtype, self._device, max_seq_len, self._batch_size)
        print(f"Loaded {what} in {time.perf_counter() - start:.1f} s (dtype {self._dtype}).", flush=True)

    def evaluate(self, cfg: DictConfig) -> Dict[str, Any]:
        """Runs the tasks; prints lm-eval's table and writes ``output_file`` when set.

        Returns:
            Dict[str, Any]: lm-eval's results (``results``, ``configs``, ``samples``, ...).
        """
        from lm_eval.evaluator import simple_evaluate
        from lm_eval.utils import handle_non_serializable, make_table

        start = time.perf_counter()
        output = simple_evaluate(
            model=self.lm,
            tasks=self.tasks,
            num_fewshot=recipe_setting(cfg, "num_fewshot", EVAL_SCHEMA),
            limit=recipe_setting(cfg, "limit", EVAL_SCHEMA),
            task_manager=self._task_manager,
            log_samples=self._output_file is not None,
            bootstrap_iters=int(recipe_setting(cfg, "bootstrap_iters", EVAL_SCHEMA)),
            random_seed=self._seed,
        )
        print(f"Evaluated {self.tasks} in {time.perf_counter() - start:.1f} s.\n{make_table(output)}", flush=True)
        if self._device.type == "cuda":
            print(f"Peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        if self._output_file is not None:
            path = Path(self._output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(output, default=handle_non_serializable, indent=2))
            os.replace(tmp, path)
            print(f"Results (lm-eval's JSON, with every sample's scores) written to {path}", flush=True)
        return output


def _task_manager(tasks: List[str], include_path: Any) -> Any:
    """lm-eval's task registry (with ``include_path``'s tasks), the tasks checked against it before anything loads.

    Raises:
        ConfigError: naming each task that is neither a task, group or tag of the registry nor a YAML file, with the
            close matches.
    """
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    known = manager.all_tasks
    problems = []
    for task in tasks:
        if task in known or Path(str(task)).is_file():
            continue
        close = difflib.get_close_matches(str(task), known, n=3, cutoff=0.6)
        names = [repr(name) for name in close]
        names[-2:] = [" or ".join(names[-2:])] if names else []
        hint = f"did you mean {', '.join(names)}?" if close else "`lm-eval ls tasks` lists them"
        where = "" if include_path else " (a local task: include_path=<its folder>)"
        problems.append(f"tasks: {task!r} is not an lm-eval task, group or tag: {hint}{where}")
    if problems:
        raise ConfigError("\n".join(problems), "tasks")
    return manager


def run_eleuther_eval(cfg: DictConfig) -> Dict[str, Any]:
    """The recipe: check settings, load, evaluate.

    Args:
        cfg (DictConfig): the config (see :class:`EleutherEvalRecipe`).

    Returns:
        Dict[str, Any]: lm-eval's results.
    """
    recipe = EleutherEvalRecipe(cfg)
    recipe.setup(cfg)
    return recipe.evaluate(cfg)
