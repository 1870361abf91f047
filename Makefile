# One-command workflows. Each target creates .venv if it is missing, installs
# what it needs, and builds the native library against the TensorFlow there.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests and the demo use TensorFlow's CPU build, installed only when the
# environment has no TensorFlow: a GPU build already there is kept.
TF_PACKAGE ?= tensorflow-cpu==2.21.*
PYTEST_ARGS ?=

.PHONY: venv deps build docs test-docs test test-all test-native test-asan test-compat test-sanitized test-mutants demo demo-quick examples-quick bench bench-images bench-cluster bench-resume bench-full-store clean

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

# The documentation site: the guide (docs/*.md, MyST) and the API reference
# from the docstrings (autodoc + napoleon), into build/docs/html. Any Sphinx
# warning (a broken reference, a docstring that does not parse, a name
# Sphinx cannot resolve) fails the build.
DOCS_OUT ?= build/docs/html
$(VENV)/.docs-deps: requirements-docs.txt | $(VENV)/.deps
	$(PY) -m pip install --quiet -r requirements-docs.txt
	touch $@

# autodoc imports tfray: built here only if it is not yet (a build always
# recompiles, and CI's `make test` has just built it).
docs: $(VENV)/.docs-deps
	$(PY) -c "import tfray" 2>/dev/null || $(MAKE) build
	rm -rf $(DOCS_OUT)
	$(PY) -m sphinx -W --keep-going -n -q -b html docs $(DOCS_OUT)
	@echo "docs built in $(DOCS_OUT)/index.html"

# The documentation's tests alone (`make test` runs them too): every code
# block of README.md and docs/ and every docstring example runs, and the
# troubleshooting page lists every message tfray raises or logs.
test-docs: build
	$(PY) -m pytest tests/docs $(PYTEST_ARGS)

# tests/native builds the channel under ASan/UBSan on its own: test-asan runs
# it, with the sanitizers' options, so the default suite leaves it out.
test: build
	$(PY) -m pytest -m "not slow" --ignore=tests/native $(PYTEST_ARGS)

test-all: build
	$(PY) -m pytest $(PYTEST_ARGS)

# The native tests under AddressSanitizer (with LeakSanitizer) and
# UndefinedBehaviorSanitizer; any report fails the run. They build the
# channel on its own, without TensorFlow, so no tfray build is needed.
ASAN_OPTIONS ?= detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1
test-asan: deps
	ASAN_OPTIONS=$(ASAN_OPTIONS) $(PY) -m pytest tests/native/test_channel_native.py $(PYTEST_ARGS)

# The oldest supported stack (TensorFlow 2.16, Ray 2.59, numpy 1.x), pinned in
# constraints-oldest.txt, in its own virtualenv. tfray is installed the way a
# user installs it, not in place: `pip install --no-build-isolation .`, which
# also resolves install_requires, for the smoke set; then from a wheel built by
# `pip wheel`, for test_build.py.
# Run from the source tree, the tests import the installed copy (conftest.py).
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_PIP := $(COMPAT_PY) -m pip install --quiet -c constraints-oldest.txt
COMPAT_TESTS ?= tests/install/test_build.py \
	tests/sources/test_from_refs.py tests/sources/test_generators.py tests/sources/test_ray_data.py \
	tests/end_to_end/test_zero_copy.py tests/end_to_end/test_errors.py \
	tests/end_to_end/test_checkpoint.py tests/end_to_end/test_keras.py

$(COMPAT_PY):
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip

$(COMPAT_VENV)/.deps: constraints-oldest.txt | $(COMPAT_PY)
	$(COMPAT_PIP) tensorflow-cpu "ray[data]" tf-keras pybind11 setuptools wheel pytest pytest-timeout
	touch $@

test-compat: $(COMPAT_VENV)/.deps
	$(COMPAT_PY) -m pip uninstall --quiet --yes tfray
	$(COMPAT_PIP) --no-build-isolation .
	$(COMPAT_PY) -m pytest -m "not slow" $(COMPAT_TESTS) $(PYTEST_ARGS)
	rm -rf $(COMPAT_VENV)/wheel
	$(COMPAT_PY) -m pip wheel --quiet --no-build-isolation --no-deps -w $(COMPAT_VENV)/wheel .
	$(COMPAT_PIP) --force-reinstall --no-deps $(COMPAT_VENV)/wheel/tfray-*.whl
	$(COMPAT_PY) -m pytest tests/install/test_build.py $(PYTEST_ARGS)

# The native kernel and bindings built with ASan and UBSan (apart from the
# checks TensorFlow's headers cannot compile with; see setup.py) into
# $(SANITIZED), over a short test set. Python is not built with ASan, so the
# runtimes are preloaded into the test process only (tests/support/sanitized.py);
# leak checking is off (Python and TensorFlow keep memory until exit by
# design), and any other report fails the run. --capture=sys: a report is
# written to file descriptor 2, which pytest's default capture would swallow.
SANITIZED ?= build/sanitized
SANITIZED_TESTS ?= tests/sources/test_from_refs.py tests/end_to_end/test_zero_copy.py \
	tests/end_to_end/test_store_safety.py tests/end_to_end/test_errors.py tests/end_to_end/test_gil_free.py
test-sanitized: build
	TFRAY_SANITIZE=1 $(PY) setup.py -q build --build-base $(SANITIZED)
	LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	$(PY) tests/support/sanitized.py $$(ls -d $(SANITIZED)/lib.*) --capture=sys -m "not slow" $(SANITIZED_TESTS) $(PYTEST_ARGS)

# Each deliberate breakage in tests/mutants/ (a copy forced in the feeder, the
# GIL taken in GetNext, a leaked pin, a fetched-then-dropped ref, ...) built
# out of place and run against the tests that claim to catch it; every one
# must fail them, and they must pass on the unmutated tree. Not part of
# `make test` or CI: it builds the native library several times.
# MUTANTS=name ... runs only those.
MUTANTS ?=
test-mutants: deps
	$(PY) tests/mutants/run.py $(MUTANTS)

demo: build
	$(PY) examples/keras_fit.py

# The demo's path (Ray tasks -> tfray -> Keras fit) in a short run: it still
# fails unless the loss fell and every byte reached TF zero-copy.
demo-quick: build
	$(PY) examples/keras_fit.py --batches 40 --epochs 2

# The other examples in short runs; each exits non-zero when a check fails.
examples-quick: build
	$(PY) examples/parallel_generators.py --batches 24 --epochs 2
	$(PY) examples/ray_data_fit.py --rows 8192 --epochs 2
	$(PY) examples/ray_train_mwms.py --rows 512 --epochs 2
	$(PY) examples/ray_train_resume.py
	$(PY) examples/multi_worker.py --timeout 300

# BENCH_ARGS go to the benchmark, e.g. BENCH_ARGS=--quick for a short run.
BENCH_ARGS ?=
bench: build
	$(PY) benchmarks/run.py $(BENCH_ARGS)

# JPEG files decoded, cropped, flipped and normalized into batches for an
# input-only consumer and a small Keras model, in each way a TensorFlow user
# would try (tf.data's C++ ops, numpy_function, a multiprocessing pool, Ray
# Data, tfray); the files are made once under benchmarks/data/. About 15
# minutes; BENCH_ARGS=--quick for about 3.
bench-images: build
	$(PY) benchmarks/end_to_end.py $(BENCH_ARGS)

# Two Ray nodes on this machine, each its own `ray start`, store and core:
# the trainer's (--num-cpus=0, core 0) and an input node (core 1), with a
# tf.data service worker on core 1 too. One tf.data image pipeline: local
# tf.data, tf.data service, tfray across the nodes and on the trainer's
# node, Ray's own loop across them; then ready batches (1, 12, 38 MB, no
# producer work), tfray against Ray's own loop. Needs 2 cores and taskset;
# about 15 minutes; BENCH_ARGS=--quick for 3, "--rows ready" for the ready
# rows alone, "--link 4gbit" to limit loopback (the link between the
# nodes) by a token bucket for the run (root, tc).
bench-cluster: build
	$(PY) benchmarks/cluster.py --chart benchmarks/cluster.png $(BENCH_ARGS)

# What a restart costs (benchmarks/resume.py): a process reads 10%, 50% or
# 90% of an epoch, checkpoints its iterator and exits; a fresh one restores
# and reads the rest. Batches the producers made after the restore against
# the batches left, the time to the first batch, and whether the rest is an
# uninterrupted epoch's. About 4 minutes; BENCH_ARGS=--quick for 1.
bench-resume: build
	$(PY) benchmarks/resume.py $(BENCH_ARGS)

# A full object store (benchmarks/full_store.py): 150 batches of 2 MB
# through shuffle(100) in a 150 MB store, from_refs and from_generators.
# Ray's restored objects against the batches, every batch once, tfray's
# warning. About a minute.
bench-full-store: build
	$(PY) benchmarks/full_store.py $(BENCH_ARGS)

clean:
	rm -rf build *.egg-info tfray/_native*.so tfray/_build_info.py .pytest_cache
