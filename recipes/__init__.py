"""Recipes: thin subclasses of ``torchtune_ext.training.QLoRARecipe``, run with ``tune run recipes/<recipe>.py
--config <yaml>`` from a clone, or ``tune-ext run <recipe> --config <model>/<config>`` after ``pip install``
(installed as ``torchtune_ext.recipes``). The step to hack is in the recipe file; the setup and the loop that both
recipes share are in the library class (``docs/hacking.md`` says why). A recipe never imports another recipe.

A regular package: ``tune run`` imports ``recipes/<recipe>.py`` as the module ``recipes.<recipe>``; torchtune's
unimportable placeholder ``recipes`` package in site-packages would shadow this folder, which
``torchtune_ext/_compat.py``'s import hook resolves.
"""
