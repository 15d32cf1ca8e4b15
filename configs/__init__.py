"""The recipes' YAML configs (``<model>/<config>.yaml``), installed as ``torchtune_ext.configs`` so that
``tune-ext ls/cp/run`` find them after a plain ``pip install``."""
