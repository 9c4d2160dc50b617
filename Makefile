# Two entry points a newcomer needs; each creates the project virtualenv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml plugin/pyproject.toml plugin/CMakeLists.txt plugin/src/sinkax_pjrt.cc
	$(PYTHON) -m venv $(VENV)
	@# one resolve for both; the plugin is sinkax's PJRT plugin (C++, CMake): docs/plugin.md
	$(PY) -m pip install -q -e '.[all]' ./plugin
	touch $@

.PHONY: demo test slow gpu-wheels gpu-check
demo: $(VENV)/.installed  ## train LeNet5 on the bundled MNIST sample with sinking
	$(PY) -m sinkax train

# pytest-xdist: one test process per core (at most 4: each holds a jax runtime)
XDIST := -n auto --maxprocesses 4

test: $(VENV)/.installed  ## lint + the fast test suite + the docs site (what CI runs)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q $(XDIST)
	SINKAX_TEST_DEVICE=Emulated $(PY) -m pytest -q $(XDIST) tests/test_sink.py tests/test_model.py
	$(PY) -m mkdocs build --strict --site-dir $(VENV)/site

slow: $(VENV)/.installed  ## the slow tests too
	$(PY) -m pytest -q $(XDIST) -m ''

# The GPU machine (benchmarks/gpu_check.py) has jax, flax, optax, pytest, matplotlib... but no
# grain and not all of grain's needs, and reaches no package registry: these travel as wheels.
GPU_WHEELS := grain==0.2.18 array-record==0.8.6 portpicker==1.6.0
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64 manylinux1_x86_64

define COPY_PJRT_HEADER
import importlib.util, os, shutil
spec = importlib.util.find_spec("xla_plugins.xla_cpu_pjrt")
os.makedirs(".whl/include", exist_ok=True)
shutil.copy(os.path.join(spec.submodule_search_locations[0], "include", "pjrt_c_api.h"), ".whl/include")
endef
export COPY_PJRT_HEADER

gpu-wheels:  ## download the wheels a bare GPU machine lacks (CPython 3.12, x86-64) into .whl/
	rm -rf .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl $(GPU_WHEELS)
	@# the PJRT C API header the plugin is built with here, for gpu_check's plugin part: it
	@# travels in the ignored .whl/ and is never committed
	-@$(PY) -c "$$COPY_PJRT_HEADER" && echo "copied pjrt_c_api.h into .whl/include/"
	@ls -R .whl && du -ch .whl/*.whl | tail -n 1

gpu-check:  ## verify sinkax on this machine's GPU in minutes (a CPU dry run without one)
	$(PYTHON) benchmarks/gpu_check.py
