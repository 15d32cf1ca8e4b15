"""Every ``>>>`` example in a docstring of ``torchtune_ext`` runs, and prints what it says (doctest): an example
that no longer works fails here instead of misleading a reader."""

import doctest
import importlib
import pkgutil
from typing import List

import pytest

import torchtune_ext

# Modules that need an optional extra (they raise an ImportError that names the extra when it is missing).
OPTIONAL_DEPENDENCIES = {"lm_eval", "gguf", "llama_cpp"}


def _import_unless_extra_missing(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        missing = error if isinstance(error, ModuleNotFoundError) else error.__cause__
        if isinstance(missing, ModuleNotFoundError) and (missing.name or "").split(".")[0] in OPTIONAL_DEPENDENCIES:
            return None
        raise


def _examples() -> List[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for info in pkgutil.walk_packages(torchtune_ext.__path__, prefix="torchtune_ext."):
        module = _import_unless_extra_missing(info.name)
        if module is None:
            continue
        found += [test for test in finder.find(module) if test.examples and test.name.startswith(info.name)]
    return sorted(found, key=lambda test: test.name)


EXAMPLES = _examples()


def test_examples_are_found():
    names = {test.name.rpartition(".")[2] for test in EXAMPLES}
    assert {"get_full_state_dict", "get_model_state_dict", "load_full_state_dict", "linear_nf4"} <= names


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name for test in EXAMPLES])
def test_docstring_example_runs(example):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: List[str] = []
    runner.run(example, out=report.append)
    assert runner.failures == 0, "".join(report)
