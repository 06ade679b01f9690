# make demo: environment + install + the main demo (all GPUs if present, else 4 cpu ranks)
# make test: environment + install + the cpu test suite (interpreter ranks + sm_90 compile checks); the 30 slowest
# tests listed at the end, so that a CI log shows where its time goes
# Every command runs the venv's own python and `weft` (`source .venv/bin/activate` puts them on PATH).
# make docs: environment + the docs extra + the documentation site into site/ (mkdocs build --strict)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo test wheel-check docs env gpu clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/weft demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=30

# The wheel as a user installs it, in a fresh venv: imports and a tutorial through its `weft` command.
wheel-check: $(STAMP)
	VENV=$(VENV) bash .ci/wheel_check.sh

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

# Every warning is an error (mkdocs.yml: strict); the two variables silence a banner about MkDocs' future.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(PY) -m mkdocs build --strict

# On the GPU machine (torch and triton preinstalled): PYTHONPATH=. bash scripts/gpu_suite.sh
gpu:
	bash scripts/gpu_suite.sh

clean:
	rm -rf $(VENV) bench_results site
