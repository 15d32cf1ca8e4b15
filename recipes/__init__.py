"""Recipes: self-contained scripts run with ``tune run recipes/<recipe>.py --config <yaml>``.

This file makes ``recipes`` a regular package, so that with the repo root on ``PYTHONPATH`` it wins over the
``recipes`` package that torchtune installs into site-packages (whose ``__init__`` raises on import).
"""
