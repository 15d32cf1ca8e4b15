"""QLoRA model builders: torchtune's architectures with NF4 bases in an explicit compute dtype.

Each ``qlora_*`` builder takes the matching torchtune ``lora_*`` builder's arguments plus ``dtype``,
``adapter_dtype``, ``device`` (default "meta") and ``seed``; see :func:`build_qlora`.
"""

from torchtune.models.llama2 import lora_llama2_7b, lora_llama2_13b, lora_llama2_70b
from torchtune.models.llama3_1 import lora_llama3_1_8b, lora_llama3_1_70b
from torchtune.models.llama3_2 import lora_llama3_2_1b, lora_llama3_2_3b
from torchtune.models.mistral import lora_mistral_7b
from torchtune.models.phi3 import lora_phi3_mini
from torchtune.models.qwen2_5 import (
    lora_qwen2_5_0_5b,
    lora_qwen2_5_1_5b_instruct,
    lora_qwen2_5_3b,
    lora_qwen2_5_7b_instruct,
)

from torchtune_ext.models._chat_tokenizers import (
    Gemma2ChatTokenizer,
    Llama3ChatTokenizer,
    Phi3ChatTokenizer,
    Qwen2_5ChatTokenizer,
    Qwen3ChatTokenizer,
    SmolLM2Tokenizer,
    gemma_tokenizer,
    llama3_tokenizer,
    phi3_mini_tokenizer,
    qwen2_5_tokenizer,
    qwen3_tokenizer,
    smollm2_tokenizer,
)
from torchtune_ext.models._from_hf import torchtune_builder_for
from torchtune_ext.models._gemma2 import lora_gemma2, lora_gemma2_2b, lora_gemma2_9b, lora_gemma2_27b
from torchtune_ext.models._init import check_adapter_state, init_adapters_, init_weights_, materialize_
from torchtune_ext.models._inst_tokenizers import (
    Llama2ChatTokenizer,
    MistralChatTokenizer,
    llama2_tokenizer,
    mistral_tokenizer,
)
from torchtune_ext.models._phi3 import lora_phi, lora_phi3_5_mini, lora_phi4_mini
from torchtune_ext.models._phi4_mini_tokenizer import Phi4MiniTokenizer, phi4_mini_tokenizer
from torchtune_ext.models._qlora import build_qlora, qlora_builder
from torchtune_ext.models._qwen3 import (
    lora_qwen3,
    lora_qwen3_0_6b,
    lora_qwen3_1_7b,
    lora_qwen3_4b,
    lora_qwen3_8b,
    lora_qwen3_14b,
)
from torchtune_ext.models._smollm2 import lora_smollm2, lora_smollm2_1_7b, lora_smollm2_135m, lora_smollm2_360m
from torchtune_ext.models._tiny import (
    TINY_LLAMA_ARGS,
    TINY_QWEN_ARGS,
    lora_tiny_llama,
    lora_tiny_qwen,
    qlora_tiny_llama,
    qlora_tiny_qwen,
)

qlora_llama2_7b = qlora_builder(lora_llama2_7b)
qlora_llama2_13b = qlora_builder(lora_llama2_13b)
qlora_llama2_70b = qlora_builder(lora_llama2_70b)
qlora_llama3_1_8b = qlora_builder(lora_llama3_1_8b)
qlora_llama3_1_70b = qlora_builder(lora_llama3_1_70b)
qlora_llama3_3_70b = qlora_llama3_1_70b  # Llama 3.3 70B: Llama 3.1 70B's architecture (as torchtune)
qlora_llama3_2_1b = qlora_builder(lora_llama3_2_1b)
qlora_llama3_2_3b = qlora_builder(lora_llama3_2_3b)
qlora_qwen2_5_0_5b = qlora_builder(lora_qwen2_5_0_5b)
qlora_qwen2_5_1_5b_instruct = qlora_builder(lora_qwen2_5_1_5b_instruct)
qlora_qwen2_5_3b = qlora_builder(lora_qwen2_5_3b)
qlora_qwen2_5_7b_instruct = qlora_builder(lora_qwen2_5_7b_instruct)
qlora_mistral_7b = qlora_builder(lora_mistral_7b)
qlora_smollm2 = qlora_builder(lora_smollm2)
qlora_smollm2_135m = qlora_builder(lora_smollm2_135m)
qlora_smollm2_360m = qlora_builder(lora_smollm2_360m)
qlora_smollm2_1_7b = qlora_builder(lora_smollm2_1_7b)
qlora_qwen3 = qlora_builder(lora_qwen3)
qlora_qwen3_0_6b = qlora_builder(lora_qwen3_0_6b)
qlora_qwen3_1_7b = qlora_builder(lora_qwen3_1_7b)
qlora_qwen3_4b = qlora_builder(lora_qwen3_4b)
qlora_qwen3_8b = qlora_builder(lora_qwen3_8b)
qlora_qwen3_14b = qlora_builder(lora_qwen3_14b)
qlora_gemma2 = qlora_builder(lora_gemma2)  # Gemma 2
qlora_gemma2_2b = qlora_builder(lora_gemma2_2b)
qlora_gemma2_9b = qlora_builder(lora_gemma2_9b)
qlora_gemma2_27b = qlora_builder(lora_gemma2_27b)
qlora_phi3_mini = qlora_builder(lora_phi3_mini)  # Phi-3-mini-4k (plain RoPE)
qlora_phi3_5_mini = qlora_builder(lora_phi3_5_mini)  # LongRoPE from the checkpoint's config.json
qlora_phi4_mini = qlora_builder(lora_phi4_mini)

#: our builder -> the torchtune builder it wraps (tests compare the two).
QLORA_BUILDERS = {
    qlora_llama2_7b: lora_llama2_7b,
    qlora_llama2_13b: lora_llama2_13b,
    qlora_llama2_70b: lora_llama2_70b,
    qlora_llama3_1_8b: lora_llama3_1_8b,
    qlora_llama3_1_70b: lora_llama3_1_70b,
    qlora_llama3_2_1b: lora_llama3_2_1b,
    qlora_llama3_2_3b: lora_llama3_2_3b,
    qlora_qwen2_5_0_5b: lora_qwen2_5_0_5b,
    qlora_qwen2_5_1_5b_instruct: lora_qwen2_5_1_5b_instruct,
    qlora_qwen2_5_3b: lora_qwen2_5_3b,
    qlora_qwen2_5_7b_instruct: lora_qwen2_5_7b_instruct,
    qlora_mistral_7b: lora_mistral_7b,
    qlora_smollm2_135m: lora_smollm2_135m,
    qlora_smollm2_360m: lora_smollm2_360m,
    qlora_smollm2_1_7b: lora_smollm2_1_7b,
    qlora_qwen3_0_6b: lora_qwen3_0_6b,
    qlora_qwen3_1_7b: lora_qwen3_1_7b,
    qlora_qwen3_4b: lora_qwen3_4b,
    qlora_qwen3_8b: lora_qwen3_8b,
    qlora_qwen3_14b: lora_qwen3_14b,
    qlora_gemma2_2b: lora_gemma2_2b,
    qlora_gemma2_9b: lora_gemma2_9b,
    qlora_gemma2_27b: lora_gemma2_27b,
    qlora_phi3_mini: lora_phi3_mini,
    qlora_tiny_llama: lora_tiny_llama,
    qlora_tiny_qwen: lora_tiny_qwen,
}
__all__ = [
    "Gemma2ChatTokenizer",
    "Llama2ChatTokenizer",
    "Llama3ChatTokenizer",
    "MistralChatTokenizer",
    "Phi3ChatTokenizer",
    "Qwen2_5ChatTokenizer",
    "Qwen3ChatTokenizer",
    "SmolLM2Tokenizer",
    "gemma_tokenizer",
    "llama2_tokenizer",
    "llama3_tokenizer",
    "mistral_tokenizer",
    "phi3_mini_tokenizer",
    "qwen2_5_tokenizer",
    "qwen3_tokenizer",
    "smollm2_tokenizer",
    "torchtune_builder_for",
    "QLORA_BUILDERS",
    "TINY_LLAMA_ARGS",
    "TINY_QWEN_ARGS",
    "build_qlora",
    "check_adapter_state",
    "init_adapters_",
    "init_weights_",
    "lora_gemma2",
    "lora_gemma2_2b",
    "lora_gemma2_9b",
    "lora_gemma2_27b",
    "qlora_gemma2",
    "lora_phi",
    "lora_phi3_5_mini",
    "lora_phi4_mini",
    "Phi4MiniTokenizer",
    "phi4_mini_tokenizer",
    "qlora_llama3_3_70b",
    "qlora_phi3_5_mini",
    "qlora_phi4_mini",
    "lora_smollm2",
    "lora_smollm2_135m",
    "lora_smollm2_360m",
    "lora_smollm2_1_7b",
    "lora_tiny_llama",
    "lora_tiny_qwen",
    "materialize_",
    "qlora_builder",
    "qlora_smollm2",
    "lora_qwen3",
    "lora_qwen3_0_6b",
    "lora_qwen3_1_7b",
    "lora_qwen3_4b",
    "lora_qwen3_8b",
    "lora_qwen3_14b",
    "qlora_qwen3",
    *[builder.__name__ for builder in QLORA_BUILDERS],
]
