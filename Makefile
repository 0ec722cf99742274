# Everything that needs Python depends on .venv, so a fresh clone needs only `make <target>`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all test-slow test-deep demo bench bench-train bench-zoo bench-compile bench-dist conformance clean

install: $(STAMP)

# torch==2.13.0 first: that pin takes the CPU wheel on these machines; an unpinned torch would
# pull a multi-GB CUDA build.  The tokamax extra (121 MB installed, a few seconds from the
# registry) so that tests/test_tokamax.py runs in CI rather than skipping.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench,tokamax]'
	# the host kernels (torch's CPU products inside XLA programs), built into the cache folder
	# now rather than at first use; a failure is not fatal (XLA's own dots run instead)
	-$(PY) -m deferfuse.native
	touch $(STAMP)

# make test: the suite without the tests marked slow (under 10 minutes on 2 cores); make
# test-all: every test, the slow ones (the whole client corpus, the conformance subset loaded
# from disk, the biggest models) included.  CI (.ci/run) runs make test, then make test-slow.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "slow or not slow" tests

# the slow tests alone (make test, then this: together, make test-all)
test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m slow tests

test-deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest -q -n 2 tests

demo: $(STAMP)
	$(PY) -m bench.demo

bench: $(STAMP)
	$(PY) -m bench.run

# The GPT training step (issue 6): strict vs defer vs torch.compile vs JAX, interleaved.
# BENCH_TRAIN_ARGS adds options, e.g. BENCH_TRAIN_ARGS="--quick" or "--only strict,defer".
bench-train: $(STAMP)
	$(PY) -m bench.train_gpt $(BENCH_TRAIN_ARGS)

# The model zoo (bench/zoo.py): real Hugging Face and torch.nn models, strict vs defer vs the
# deferred engine, training steps and generate().  BENCH_ZOO_ARGS adds options, e.g.
# BENCH_ZOO_ARGS="--size tiny" or "--only llama,gpt2".
bench-zoo: $(STAMP)
	$(PY) -m bench.zoo $(BENCH_ZOO_ARGS)

# torch.compile(backend="deferfuse") vs strict and Inductor on the zoo's Llama step (bench/compile.py)
bench-compile: $(STAMP)
	$(PY) -m bench.compile $(BENCH_COMPILE_ARGS)

# torch.distributed on 2 gloo ranks (bench/dist.py): a DDP step of a zoo model and a 2-stage
# pipeline, strict vs defer.  BENCH_DIST_ARGS adds options, e.g. BENCH_DIST_ARGS="--size small".
bench-dist: $(STAMP)
	$(PY) -m bench.dist $(BENCH_DIST_ARGS)

# The OpInfo conformance sweep (docs/conformance.md): every OpInfo x dtype x variant, strict vs
# defer.  CONFORMANCE_ARGS adds options, e.g. CONFORMANCE_ARGS="--max-samples 0" for every sample.
conformance: $(STAMP)
	$(PY) -m conformance.sweep --subset full $(CONFORMANCE_ARGS) \
		--json conformance/results/full.json --markdown docs/conformance.md

clean:
	rm -rf $(VENV) build *.egg-info
