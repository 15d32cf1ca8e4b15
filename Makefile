# Two commands for a fresh machine (each sets itself up):
#   make demo   - fine-tune the embedded tiny default (no downloads), print where the outputs are, and answer two
#                 held-out prompts with the trained model (NF4 base + adapter)
#   make test   - .ci/run: set-up, lint + the whole test suite (unit, recipe integration, 2-process distributed)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel that lies on the machine (a bare 'torch' pulls a CUDA build).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tune run recipes/qlora_finetune_single_device.py --config configs/tiny/qlora_single_device.yaml
	$(VENV)/bin/tune run recipes/generate.py --config configs/tiny/generation.yaml

# The same install as .ci/run, which `make test` runs (CI runs it too).
test:
	bash .ci/run

clean:
	rm -rf $(VENV) .venv-interop
