"""The ``eleuther_eval`` recipe's logic: the model (as it trained, or merged) behind lm-eval's ``TemplateLM``.

torchtune's ``_LLMEvalWrapper`` builds lm-eval's ``HFLM`` around a downloaded ``gpt2`` before swapping the model in,
which needs the network at run time; :class:`TorchtuneLM` implements lm-eval's ``TemplateLM`` directly instead (the
same scoring: no BOS on the encoded text, log-softmax of the logits over the continuation's tokens)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchtune import config, training, utils
from torchtune.training import FullModelHFCheckpointer

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.checkpoint import read_hf_config
from torchtune_ext.generation import Generator, SamplingSettings, load_model_with_adapter
from torchtune_ext.models import torchtune_builder_for
from torchtune_ext.training import build_tokenizer

try:
    from lm_eval.api.model import TemplateLM
except ImportError as error:  # the optional extra
    raise ImportError(
        "The eleuther_eval recipe needs EleutherAI's lm-eval harness: pip install 'torchtune_ext[eval]' "
        "(or pip install 'lm-eval>=0.4.5')."
    ) from error

_GREEDY_ONLY = "lm-eval asked for sampling ({}); this evaluator decodes greedily only."


class TorchtuneLM(TemplateLM):
    """lm-eval's model interface over a torchtune decoder and tokenizer (single device).

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` in eval mode.
        tokenizer (Any): its torchtune tokenizer (``encode``, ``decode``, ``eos_id``, ``bos_id``).
        dtype (torch.dtype): compute dtype (the KV caches' in ``generate_until``).
        device (torch.device): the model's device.
        max_seq_len (int): longest scored sequence (longer inputs keep their last tokens).
        batch_size (int): sequences per forward when scoring.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        dtype: torch.dtype,
        device: torch.device,
        max_seq_len: int,
        batch_size: int,
    ):
        super().__init__()
        self._model = model
        self._tokenizer = tokenizer
        self._device = device
        self._max_seq_len = max_seq_len
        self._batch_size = batch_size
        self._generator = Generator(model, tokenizer, dtype, device, max_seq_len)

    @property
    def eot_token_id(self) -> int:
        return self._tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """BOS (else EOS) stands in for an empty context, as in lm-eval's ``HFLM``."""
        bos = getattr(self._tokenizer, "bos_id", None)
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_seq_len

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> List[int]:
        """Tokens of ``string`` without BOS/EOS (torchtune's ``_LLMEvalWrapper`` choice)."""
        return list(self._tokenizer.encode(string, add_bos=False, add_eos=False))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self._generator.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: List[Tuple[Any, List[int], List[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> List[Tuple[float, bool]]:
        results: List[Tuple[float, bool]] = []
        for start in range(0, len(requests), self._batch_size):
            results += self._score_batch([(ctx, cont) for _, ctx, cont in requests[start : start + self._batch_size]])
        return results

    def _score_batch(self, pairs: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        """Sum of log-probabilities of each continuation and whether it is the greedy one."""
        inputs = [(ctx + cont)[-(self._max_seq_len + 1) :][:-1] for ctx, cont in pairs]
        width = max(len(x) for x in inputs)
        batch = torch.zeros(len(inputs), width, dtype=torch.long)
        for row, tokens in enumerate(inputs):
            batch[row, : len(tokens)] = torch.tensor(tokens)  # right padding: causal, earlier positions unaffected
        logits = self._model(batch.to(self._device))
        logits = torch.cat(logits, dim=1) if isinstance(logits, list) else logits
        results = []
        for row, ((_, cont), tokens) in enumerate(zip(pairs, inputs)):
            scores = logits[row, len(tokens) - len(cont) : len(tokens)].float().log_softmax(dim=-1)
            target = torch.tensor(cont, device=scores.device)
            logprob = scores.gather(-1, target[:, None]).sum().item()
            results.append((logprob, bool((scores.argmax(dim=-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        """Perplexity-style scores: the whole text in disjoint rolling windows of ``max_length``."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        scores = []
        for request in requests:
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pairs = [(None, *make_disjoint_window(w)) for w in windows]
            scores.append(sum(lp for lp, _ in self._loglikelihood_tokens(pairs)))
        return scores

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        """Greedy answers (KV-cached), cut before the request's ``until`` strings."""
        answers = []
        for request in requests:
            context, gen_kwargs = request.args
            if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0.0) or 0.0) != 0.0:
                raise ValueError(_GREEDY_ONLY.format(gen_kwargs))
            until = gen_kwargs.get("until") or []
            settings = SamplingSettings(
                max_new_tokens=int(gen_kwargs.get("max_gen_toks", 256)),
                stop=tuple([until] if isinstance(until, str) else until),
            )
            prompt = self.tok_encode(context)[-(self._max_seq_len - settings.max_new_tokens) :]
            answers.append(self._generator.generate(prompt, settings).text)
        return answers


def load_merged_model(merged_dir: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A merged HF folder (e.g. ``tune-ext merge``'s output) as a plain torchtune decoder, in ``dtype``.

    Args:
        merged_dir (str): the folder (``config.json`` + safetensors).
        dtype (torch.dtype): the weights' and compute dtype.
        device (torch.device): where the model goes.

    Returns:
        nn.Module: the model in eval mode, no gradients.

    Raises:
        FileNotFoundError: if the folder has no ``config.json`` or no safetensors file.
    """
    folder = Path(merged_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"merged_dir={merged_dir}: no config.json there; give a merged HF model folder.")
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"merged_dir={merged_dir}: no *.safetensors file there; give a merged HF folder.")
    lora_builder, args, model_type = torchtune_builder_for(read_hf_config(folder))
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

    Config keys: ``model``, ``tokenizer``, ``checkpointer`` and ``adapter_dir`` (the model as it trained: the base
    streamed into NF4 + the adapter; null adapter: the base alone) or ``merged_dir`` (a merged HF folder, loaded in
    ``dtype``; then ``model``/``checkpointer``/``adapter_dir`` are not used); ``tasks`` (lm-eval task names),
    ``include_path`` (a folder of local task YAMLs), ``limit``, ``num_fewshot``, ``batch_size``, ``max_seq_len``,
    ``dtype``, ``device``, ``seed``, ``output_file`` (results JSON, with the per-sample scores).

    Args:
        cfg (DictConfig): the config.

    Raises:
        ValueError: on an empty task list or a bad ``batch_size`` / ``max_seq_len``, naming the key.
        FileNotFoundError: on a missing ``include_path`` or ``merged_dir``.
    """

    def __init__(self, cfg: DictConfig):
        self._device = utils.get_device(device=cfg.device)
        self._dtype = parse_dtype(cfg.get("dtype", "fp32"), self._device)
        tasks = cfg.get("tasks", None)
        self.tasks = list(tasks) if isinstance(tasks, (list, ListConfig)) else ([tasks] if tasks else [])
        if not self.tasks:
            raise ValueError("tasks is empty: name lm-eval tasks, e.g. tasks=[arc_easy,hellaswag].")
        for key in ("batch_size", "max_seq_len"):
            if not isinstance(cfg.get(key, None), int) or cfg[key] < 1:
                raise ValueError(f"{key}={cfg.get(key, None)!r} must be a positive integer.")
        self._include_path = cfg.get("include_path", None)
        self._merged_dir = cfg.get("merged_dir", None)
        for key, path in (("include_path", self._include_path), ("merged_dir", self._merged_dir)):
            if path is not None and not Path(path).is_dir():
                raise FileNotFoundError(f"{key}={path} is not a folder.")
        self._output_file = cfg.get("output_file", None)
        training.set_seed(seed=cfg.get("seed", 1234))

    def setup(self, cfg: DictConfig) -> None:
        """Loads the tokenizer and the model (merged, or the base into NF4 + the adapter, checked first)."""
        start = time.perf_counter()
        tokenizer = build_tokenizer(cfg.tokenizer)
        if self._merged_dir is not None:
            model, what = load_merged_model(self._merged_dir, self._dtype, self._device), self._merged_dir
        else:
            checkpointer = config.instantiate(cfg.checkpointer)
            adapter_dir = cfg.get("adapter_dir", None)
            model = load_model_with_adapter(
                checkpointer, adapter_dir, model=cfg.model, dtype=self._dtype, device=self._device
            )
            what = f"{checkpointer.checkpoint_dir} into NF4 + adapter {adapter_dir}"
        max_seq_len = min(cfg.max_seq_len, model.max_seq_len)
        self.lm = TorchtuneLM(model, tokenizer, self._dtype, self._device, max_seq_len, cfg.batch_size)
        print(f"Loaded {what} in {time.perf_counter() - start:.1f} s (dtype {self._dtype}).", flush=True)

    def evaluate(self, cfg: DictConfig) -> Dict[str, Any]:
        """Runs the tasks; prints lm-eval's table and writes ``output_file`` when set.

        Returns:
            Dict[str, Any]: lm-eval's results (``results``, ``configs``, ``samples``, ...).
        """
        from lm_eval.evaluator import simple_evaluate
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable, make_table

        start = time.perf_counter()
        output = simple_evaluate(
            model=self.lm,
            tasks=self.tasks,
            num_fewshot=cfg.get("num_fewshot", None),
            limit=cfg.get("limit", None),
            task_manager=TaskManager(include_path=self._include_path),
            log_samples=self._output_file is not None,
            bootstrap_iters=int(cfg.get("bootstrap_iters", 0)),
            random_seed=cfg.get("seed", 1234),
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
        return output


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
