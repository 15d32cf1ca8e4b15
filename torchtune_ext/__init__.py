"""torchtune_ext: memory-efficient QLoRA fine-tuning on top of torchtune 0.6.1.

Importing the package applies the documented compat registrations in ``torchtune_ext._compat``.
"""

from torchtune_ext import _compat  # noqa: F401  (registers NF4 ops needed by current PyTorch)

__version__ = "0.1.0"
