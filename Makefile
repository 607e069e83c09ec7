# Two entry points that do all set-up from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 lies in /opt/wheels on these machines; pin it so pip never
# resolves a multi-GB CUDA build.
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: demo test lint docs bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install -q $(PIP_FLAGS) torch==2.13.0
	$(PY) -m pip install -q $(PIP_FLAGS) -e '.[dev]'
	touch $@

# 5-15 s of training on 2 cores (about 20 s with start-up): 13.5 MB snapshots (medium model) every 50 iterations,
# the newest 3 kept.
# Run it again to see it resume (or report the finished run); `rm -rf result/demo` starts over.
DEMO_ARGS ?= --out result/demo --iterations 300 --snapshot-interval 50 --model-size medium

demo: $(VENV)/.installed
	$(VENV)/bin/snapkeep demo $(DEMO_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

# The documentation site (mkdocs-material + mkdocstrings), built in strict mode: a broken link,
# anchor, include or API reference fails the build (and so `make test` and CI).
DOCS_SITE ?= build/site
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d $(DOCS_SITE)

test: $(VENV)/.installed lint docs
	$(PY) -m pytest -n 2 -q --durations=20

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_stall.py

clean:
	rm -rf $(VENV) result $(DOCS_SITE)
