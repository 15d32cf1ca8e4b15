"""torchtune_ext: memory-efficient QLoRA fine-tuning on top of torchtune 0.6.1.

Importing the package installs the import hook of :mod:`torchtune_ext._compat`, which applies the compatibility
aliases and registrations as torchtune and torchao are imported. Where no code of ours runs first (``tune run``,
torchrun's workers, a notebook that imports torchtune), the start-up finder of ``torchtune_ext_compat.pth``
(``torchtune_ext/_compat/_startup.py``) installs it on the first import of torchtune, torchao or ``recipes``.
Nothing heavy is imported here.
"""

from torchtune_ext import _compat

_compat.install_import_hook()

__version__ = "0.1.0"
