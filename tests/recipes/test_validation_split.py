"""Every real config carries a held-out validation split, commented out (off by default), that works uncommented."""

from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REAL = sorted(p for p in CONFIGS.glob("*/*_qlora*.yaml") if p.parent.name != "tiny")


def _uncommented(text: str) -> str:
    """The config with its held-out split switched on: the ``# split:`` line and the ``# dataset_val:`` block."""
    lines, in_block = [], False
    for line in text.splitlines():
        stripped = line.lstrip()
        in_block = stripped.startswith("# dataset_val:") or (in_block and stripped.startswith("# "))
        if in_block or stripped.startswith("# split:"):
            line = line[: len(line) - len(stripped)] + stripped[2:].split("  #")[0]
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("path", REAL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_held_out_split_is_off_by_default_and_disjoint_when_on(path):
    text = path.read_text()
    assert "dataset_val" not in yaml.safe_load(text)
    cfg = yaml.safe_load(_uncommented(text))
    assert cfg["dataset_val"]["_component_"] == cfg["dataset"]["_component_"]
    assert (cfg["dataset"]["split"], cfg["dataset_val"]["split"]) == ("train[:98%]", "train[98%:]")
    assert cfg["run_val_every_n_steps"] > 0 and cfg["max_validation_steps"] > 0
