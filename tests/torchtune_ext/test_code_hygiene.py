"""Code names no issue tracker: no ``[issue N]`` tags in the package, the recipes, the configs, bench/ or the tests
(the reasons stand in plain words; the tracker is not in the repository)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TAG = re.compile(r"\[issue \d+")


def test_no_tracker_tags_in_library_code():
    folders = ("torchtune_ext", "recipes", "configs", "bench", "tests")
    files = [p for d in folders for p in (ROOT / d).rglob("*") if p.is_file()]
    files = [p for p in files if p.suffix in {".py", ".yaml", ".sh"}] + [ROOT / "pyproject.toml"]
    tagged = [f"{p.relative_to(ROOT)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
              if TAG.search(line)]  # fmt: skip
    assert len(files) > 100 and not tagged, tagged
