"""Runs in a fresh process of the test environment, importing only transformers / peft (no torchtune, nothing of
ours): loads the folders our code wrote and writes their logits.

Usage: ``python _hf_side.py SPEC_JSON OUT_SAFETENSORS REPORT_JSON``. The spec is::

    {"input_ids": [[...], ...],
     "runs": [{"name": "merged", "model": "<HF folder>", "adapter": null, "dtype": "auto"},
              {"name": "peft", "model": "<HF base folder>", "adapter": "<PEFT adapter folder>"},
              {"name": "peft_recorded_base", "model": null, "adapter": "<PEFT adapter folder>"}]}

``"model": null`` loads the base that the adapter's ``adapter_config.json`` names (``base_model_name_or_path``), as
``AutoPeftModelForCausalLM`` would. ``"dtype"`` is what ``from_pretrained`` gets: a torch dtype name (default
``float32``) or ``"auto"`` (the dtype the folder's ``config.json`` names).

Every run's fp32 logits go into ``OUT_SAFETENSORS`` under its name. Loading is strict: a missing, unexpected or
mis-shaped weight (which transformers would otherwise initialise randomly with a warning) or an adapter tensor
that PEFT did not place exactly as saved is an error. ``REPORT_JSON`` gets, per run, the loaded model's class,
folder, class, dtype, tied embeddings and vocabulary size, so the test can name what went wrong.
"""

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def _load_model(folder: str, dtype: str) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    # transformers 4.x takes torch_dtype= (4.56+ also dtype=); 5.x takes dtype=.
    dtype_arg = "torch_dtype" if int(transformers.__version__.split(".")[0]) < 5 else "dtype"
    value = dtype if dtype == "auto" else getattr(torch, dtype)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, **{dtype_arg: value}, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise RuntimeError(f"transformers did not load {folder} cleanly: {problems} {info.get('error_msgs')}")
    return model, {
        "folder": folder,
        "class": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype),
        "tied": model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr(),
        "vocab_size": model.get_output_embeddings().weight.shape[0],
        "transformers": transformers.__version__,
    }


def _attach_adapter(model: torch.nn.Module, adapter: str) -> torch.nn.Module:
    """``PeftModel.from_pretrained``, then checks that the model's adapter state is exactly the file's."""
    from peft import PeftModel, get_peft_model_state_dict

    peft_model = PeftModel.from_pretrained(model, adapter)
    saved = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(peft_model)
    # PEFT's own file keys are the state-dict keys with the "base_model.model." prefix kept.
    if set(saved) != set(loaded):
        raise RuntimeError(
            f"PEFT placed a different set of adapter tensors than {adapter} holds: only in the file "
            f"{sorted(set(saved) - set(loaded))[:6]}, only in the model {sorted(set(loaded) - set(saved))[:6]}"
        )
    wrong = [k for k in saved if not torch.equal(saved[k].to(loaded[k].dtype), loaded[k])]
    if wrong:
        raise RuntimeError(f"PEFT loaded different values than {adapter} holds for {wrong[:6]}")
    return peft_model


@torch.no_grad()
def _logits(
    folder: Optional[str], adapter: Optional[str], input_ids: torch.Tensor, dtype: str
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    if folder is None:
        folder = json.loads((Path(adapter) / "adapter_config.json").read_text())["base_model_name_or_path"]
    model, report = _load_model(folder, dtype)
    if adapter is not None:
        model = _attach_adapter(model, adapter)
    model.eval()
    return model(input_ids=input_ids).logits.float(), report


def main(argv: List[str]) -> None:
    spec_path, out_path, report_path = argv
    spec = json.loads(Path(spec_path).read_text())
    input_ids = torch.tensor(spec["input_ids"], dtype=torch.long)
    logits, reports = {}, {}
    for run in spec["runs"]:
        logits[run["name"]], reports[run["name"]] = _logits(
            run.get("model"), run.get("adapter"), input_ids, run.get("dtype", "float32")
        )
    save_file({k: v.contiguous() for k, v in logits.items()}, out_path)
    Path(report_path).write_text(json.dumps(reports, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
