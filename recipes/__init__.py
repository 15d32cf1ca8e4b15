"""Recipes: self-contained scripts run with ``tune run recipes/<recipe>.py --config <yaml>`` from a clone, or
``tune-ext run <recipe> --config <model>/<config>`` after ``pip install`` (installed as ``torchtune_ext.recipes``).

A regular package: ``tune run`` imports ``recipes/<recipe>.py`` as the module ``recipes.<recipe>``; torchtune's
unimportable placeholder ``recipes`` package in site-packages would shadow this folder, which
``torchtune_ext/_compat.py``'s import hook resolves.
"""
