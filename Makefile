# Two commands for a fresh machine (each sets itself up):
#   make demo   - fine-tune the embedded tiny default (no downloads), print where the outputs are, and answer two
#                 held-out prompts with the trained model (NF4 base + adapter)
#   make test   - .ci/run: set-up, lint + the whole test suite in every environment, both lanes: the fast lane
#                 (in-process tests) and the slow lane (recipe runs, launched processes, 2-process distributed,
#                 llama.cpp, real models)
# and, in an existing .venv:
#   make test-fast - plain pytest: the fast lane only (in-process tests; under 10 min on 2 cores)
#   make test-slow - the slow lane only (recipe runs, launched processes, multi-rank, llama.cpp, real models, and
#                    the every-builder grids' other families)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast test-slow clean llama-cpp

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel that lies on the machine (a bare 'torch' pulls a CUDA build).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# overwrite_output_dir: each demo starts its run (outputs/tiny_qlora) over, so the demo also works a second time.
demo: $(STAMP)
	$(VENV)/bin/tune run recipes/qlora_finetune_single_device.py --config configs/tiny/qlora_single_device.yaml \
		overwrite_output_dir=True
	$(VENV)/bin/tune run recipes/generate.py --config configs/tiny/generation.yaml

# llama.cpp for `tune-ext export gguf --type q4_k_m|q5_k_m|q6_k|q4_0|q5_0` (its quantizer) and the GGUF tests that
# run the file: llama-cpp-python builds llama.cpp from source (~15 min on 2 cores); pip caches the built wheel, so
# running it again (or in a new venv) takes seconds.
llama-cpp: $(STAMP)
	CMAKE_ARGS="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
		$(PY) -m pip install 'llama-cpp-python>=0.3'

# The same install as .ci/run, which `make test` runs (CI runs it too).
test:
	bash .ci/run

# The lanes are pyproject.toml's: plain pytest deselects the slow lane's markers; -m selects them.
test-fast: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "integration_test or distributed or slow or real_model"

clean:
	rm -rf $(VENV) .venv-interop .venv-oldest .venv-torch214 .venv-torch211
