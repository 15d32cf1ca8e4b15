"""lm-eval's ``TemplateLM`` over a torchtune decoder (imported only when lm-eval, the ``eval`` extra, is installed).

torchtune's ``_LLMEvalWrapper`` builds lm-eval's ``HFLM`` around a downloaded ``gpt2`` before swapping the model in,
which needs the network at run time; :class:`TorchtuneLM` implements lm-eval's ``TemplateLM`` directly instead (the
same scoring: no BOS on the encoded text, log-softmax of the logits over the continuation's tokens)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from torchtune_ext.config import MissingExtraError
from torchtune_ext.generation import Generator, SamplingSettings

try:
    from lm_eval.api.model import TemplateLM
except ImportError as error:  # the optional extra; the recipe prints this one line, no traceback
    raise MissingExtraError(
        "lm-eval is not installed: the eleuther_eval recipe needs EleutherAI's lm-eval harness: "
        "pip install 'torchtune_ext[eval]' (or pip install 'lm-eval>=0.4.5')."
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
