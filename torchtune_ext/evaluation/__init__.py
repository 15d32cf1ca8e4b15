"""Evaluation with EleutherAI's ``lm-eval`` harness of the model as it trained (the base streamed into NF4 + a PEFT
adapter) or of a merged HF folder (``recipes/eleuther_eval.py``). Needs the ``eval`` extra: ``pip install
'torchtune_ext[eval]'``."""

from torchtune_ext.evaluation._eleuther import EleutherEvalRecipe, load_merged_model, run_eleuther_eval

__all__ = ["EleutherEvalRecipe", "load_merged_model", "run_eleuther_eval"]
