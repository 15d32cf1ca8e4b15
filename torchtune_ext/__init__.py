"""torchtune_ext: memory-efficient QLoRA fine-tuning on top of torchtune 0.6.1.

Importing the package installs the compatibility hook of :mod:`torchtune_ext._compat` (it is also installed at
interpreter start-up by ``torchtune_ext_compat.pth``); nothing heavy is imported here.
"""

from torchtune_ext import _compat

_compat.install_import_hook()

__version__ = "0.1.0"
