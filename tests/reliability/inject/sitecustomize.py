"""Test-only: pauses a recipe in the middle of writing a checkpoint, so that a test can SIGKILL it there.

Put this folder on ``PYTHONPATH`` of a test subprocess only. With ``RELIABILITY_PAUSE=<point>@<step>`` and
``RELIABILITY_MARKER=<file>`` set (and optionally ``RELIABILITY_RANK=<rank>``), the process writes its pid into
the marker file and sleeps at that point of the checkpoint save of global step ``<step>``:

- ``recipe_state``: half of ``recipe_state.pt``'s bytes are in its temporary file (``torch.save`` of the state
  whose ``global_step`` is ``<step>``, into ``.recipe_state.pt.tmp-*``).
- ``adapter``: ``adapter_model.safetensors`` of ``.step_<step>.tmp-*`` holds its header and first tensor.
- ``commit``: ``.step_<step>.tmp-*`` is complete, just before it is renamed to ``step_<step>``.

The hooks are installed when ``torchtune_ext.checkpoint._checkpointer`` is first imported (a post-import hook),
and wrap ``torch.save``, ``_safetensors.write_tensors`` and ``os.rename``; nothing changes without the variables.
"""

import importlib.abc
import importlib.machinery
import io
import os
import sys

_TARGET = "torchtune_ext.checkpoint._checkpointer"
_POINTS = ("recipe_state", "adapter", "commit")


def _config():
    spec = os.environ.get("RELIABILITY_PAUSE")
    if not spec:
        return None
    point, _, step = spec.partition("@")
    if point not in _POINTS or not step.isdigit():
        raise ValueError(f"RELIABILITY_PAUSE={spec!r}: use <point>@<step> with point in {_POINTS}")
    rank = os.environ.get("RELIABILITY_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return None
    return point, int(step), os.environ["RELIABILITY_MARKER"]


def _pause(marker: str) -> None:
    import time

    tmp = marker + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, marker)
    while True:
        time.sleep(1)


def _install(module, point: str, step: int, marker: str) -> None:
    tmp_dir = f".step_{step}.tmp-"
    if point == "recipe_state":
        import torch

        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            name = os.path.basename(str(getattr(f, "name", "")))
            if isinstance(obj, dict) and obj.get("global_step") == step and name.startswith(".recipe_state.pt.tmp-"):
                buffer = io.BytesIO()
                real_save(obj, buffer, *args, **kwargs)
                data = buffer.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                _pause(marker)
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    elif point == "adapter":
        safetensors_module = module._safetensors
        real_write = safetensors_module.write_tensors

        def write_tensors(path, specs, tensors, *args, **kwargs):
            if os.path.basename(str(path)) == "adapter_model.safetensors" and tmp_dir in str(path):
                items = iter(tensors)

                def first_then_pause():
                    yield next(items)
                    _pause(marker)

                tensors = first_then_pause()
            return real_write(path, specs, tensors, *args, **kwargs)

        safetensors_module.write_tensors = write_tensors
    else:
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if os.path.basename(str(src)).startswith(tmp_dir):
                _pause(marker)
            return real_rename(src, dst, *args, **kwargs)

        os.rename = rename


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``_install`` right after ``_TARGET`` has been executed."""

    def __init__(self, config):
        self._config = config

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            for finder in sys.meta_path:
                spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return spec
        exec_module, config = spec.loader.exec_module, self._config

        def exec_and_install(module):
            exec_module(module)
            _install(module, *config)

        spec.loader.exec_module = exec_and_install
        return spec


_CONFIG = _config()
if _CONFIG is not None:
    sys.meta_path.insert(0, _PostImportHook(_CONFIG))
