# One-command workflows. Each target creates .venv if it is missing, installs
# what it needs, and builds the native library against the TensorFlow there.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests and the demo use TensorFlow's CPU build, installed only when the
# environment has no TensorFlow: a GPU build already there is kept.
TF_PACKAGE ?= tensorflow-cpu==2.21.*
PYTEST_ARGS ?=

.PHONY: venv deps build test test-all test-native test-asan demo bench clean

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.deps: requirements-dev.txt | $(PY)
	$(PY) -c "import tensorflow" 2>/dev/null || $(PY) -m pip install --quiet "$(TF_PACKAGE)"
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

deps: $(VENV)/.deps

# Builds in place against the venv's TensorFlow; --no-build-isolation keeps
# pip from building against a second, different TensorFlow.
build: deps
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	$(PY) -c "import tfray; print('tfray built against TensorFlow', tfray._native.built_tf_version())"

test: build
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: build
	$(PY) -m pytest $(PYTEST_ARGS)

# The native tests under AddressSanitizer (with LeakSanitizer) and
# UndefinedBehaviorSanitizer; any report fails the run. They build the
# channel on its own, without TensorFlow, so no tfray build is needed.
ASAN_OPTIONS ?= detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1
test-asan: deps
	ASAN_OPTIONS=$(ASAN_OPTIONS) $(PY) -m pytest tests/test_channel_native.py $(PYTEST_ARGS)

demo: build
	$(PY) examples/keras_fit.py

bench: build
	$(PY) benchmarks/run.py

clean:
	rm -rf build *.egg-info tfray/_native*.so tfray/_build_info.py .pytest_cache
