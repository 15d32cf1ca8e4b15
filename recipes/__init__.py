"""Recipes, run with ``tune run recipes/<recipe>.py --config <yaml>`` from a clone, or ``tune-ext run <recipe>
--config <model>/<config>`` after ``pip install`` (installed as ``torchtune_ext.recipes``). Each file holds its recipe:
``qlora_finetune_single_device.py`` is the whole QLoRA recipe (setup, step, loop) for any world size, and
``qlora_finetune_distributed.py`` a thin entry point that runs it by path (``docs/hacking.md``). A recipe never
imports another recipe.

A regular package: ``tune run`` imports ``recipes/<recipe>.py`` as the module ``recipes.<recipe>``; torchtune's
unimportable placeholder ``recipes`` package in site-packages would shadow this folder, which
``torchtune_ext/_compat/``'s import hook resolves (``_recipes_package``).
"""
