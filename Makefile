# Two entry points a newcomer needs; each creates the project virtualenv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml plugin/pyproject.toml plugin/CMakeLists.txt plugin/src/sinkax_pjrt.cc
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all]'
	$(PY) -m pip install -q ./plugin  # sinkax's PJRT plugin (C++, CMake): docs/plugin.md
	touch $@

.PHONY: demo test slow
demo: $(VENV)/.installed  ## train LeNet5 on the bundled MNIST sample with sinking
	$(PY) -m sinkax train

test: $(VENV)/.installed  ## lint + the fast test suite + the docs site (what CI runs)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q
	SINKAX_TEST_DEVICE=Emulated $(PY) -m pytest -q tests/test_sink.py tests/test_model.py
	$(PY) -m mkdocs build --strict --site-dir $(VENV)/site

slow: $(VENV)/.installed  ## the slow tests too
	$(PY) -m pytest -q -m ''
