# Two commands on a fresh machine (see README.md):
#   make demo   install into .venv, profile a small MoE run on CPU, analyze it and open the report
#               (on a machine without a browser it prints the report's file:// address instead)
#   make test   install into .venv (with test tools and Chromium) and run the whole test suite, on two
#               pytest-xdist workers (a test file per worker at a time; see tests/conftest.py)
#   make lint   install into .venv and check the import layering of docs/architecture.md (import-linter
#               contracts in pyproject.toml); .ci/run runs it before the tests
#
# torch is installed first, pinned to the CPU build, so pip never pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo demo-gpu-trace test lint install browser clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[trainer,kernels,tune,dev]"
	touch $(STAMP)

# The compiled scanner, tree linking and walk (optional: setup.py builds them where a C compiler exists) again whenever their
# source changed since the last build, so an existing checkout never runs a stale one after a pull.
SCANNER := $(VENV)/.scanner-built
$(SCANNER): tracelens/io/_kineto_fast.c tracelens/analysis/_tree.c tracelens/analysis/_walk.c setup.py $(STAMP)
	$(PY) setup.py -q build_ext --inplace
	touch $(SCANNER)

install: $(STAMP) $(SCANNER)

# Debian's Chromium for the real-browser report test (Playwright drives /usr/bin/chromium; it never
# downloads a browser of its own).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi; }

# The main job: train a tiny DeepSeek-style MoE on the CPU (10 steps, steps 3-4 profiled), analyze its
# trace and open the report (tracelens says whether it could). `make demo-gpu-trace` analyzes a bundled
# real 2-GPU H200 trace instead. The commands are in .venv/bin: the README's use them by that path.
demo: install
	$(VENV)/bin/tracelens profile --config tiny -o runs/demo --open
	@echo "next: the commands under 'Use it' in README.md, e.g. $(VENV)/bin/tracelens analyze runs/demo" \
	      "(or 'source $(VENV)/bin/activate' once, then plain 'tracelens ...')"

demo-gpu-trace: install
	$(VENV)/bin/tracelens analyze tests/fixtures/h200_nccl_2rank -o out/demo --open

# Two workers, whole files each (module fixtures built once), files with slow tests handed out first in
# collection order (--no-loadscope-reorder: xdist would otherwise start with the files of most tests).
test: install browser
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The layering contracts ([tool.importlinter] in pyproject.toml): which package may import which, no
# import cycles. lint-imports puts the checkout first on sys.path, so it reads this tree's modules.
lint: $(STAMP)
	$(VENV)/bin/lint-imports --no-logo --no-cache

clean:
	rm -rf $(VENV) out runs/demo .pytest_cache
