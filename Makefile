# The front door: `make demo` runs the main job end to end, `make test` runs the tests.
# Both install what they need first (torch 2.13.0 is the CPU build this machine has on disk).
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install install-dev demo test bench

install:
	$(PIP_INSTALL) torch==2.13.0 -e '.[s3,progress]'

install-dev:
	$(PIP_INSTALL) torch==2.13.0 -e '.[dev]'

demo: install
	ckptstream demo

test: install-dev
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) tools/bench_publish.py
