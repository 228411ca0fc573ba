# Two commands for a fresh machine: `make demo` and `make test`. Both set up .venv/ if missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch the tests run on; pyproject.toml states the range users may have.
TORCH ?= torch==2.13.0
# Where the first torch install looks (empty: pip's configured index). Which build pip picks is up to
# that index: this machine's pip config finds a CPU wheel in /opt/wheels, while plain PyPI on Linux
# x86_64 gives the CUDA build (several GB). For a CPU build elsewhere:
#   make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=

# Setting any of the three above on the command line (or in the environment) counts on a venv that
# is already set up, not only on a fresh one: the stamp knew only pyproject.toml, so
# `make demo TORCH_INDEX_URL=...` or `make test TORCH=torch==2.11.0` on an existing .venv installed
# nothing and ran on the old torch without a word. A setup writes what it installed with into
# SETUP_INPUTS; a run with other values installs again into the same venv. TORCH is each run's own
# (a run that names none goes back to the pin above); the index and the Python stay the venv's.
SETUP_INPUTS := $(VENV)/.setup-inputs
given = $(filter-out undefined default file,$(origin $(1)))
RECORDED := $(strip $(shell cat $(SETUP_INPUTS) 2>/dev/null))
recorded = $(patsubst $(1)=%,%,$(filter $(1)=%,$(RECORDED)))
# The index stays the venv's until another is named (TORCH_INDEX_URL= names pip's own again): a plain
# `make test` after the README's `make demo TORCH_INDEX_URL=.../cpu` must not fetch the CUDA build.
ifneq ($(RECORDED),)
ifeq ($(call given,TORCH_INDEX_URL),)
TORCH_INDEX_URL := $(call recorded,TORCH_INDEX_URL)
endif
endif
SETUP_NOW := TORCH=$(TORCH) TORCH_INDEX_URL=$(TORCH_INDEX_URL)
ifneq ($(RECORDED),)
ifneq ($(RECORDED),$(strip $(SETUP_NOW)))
SETUP_CHANGED := yes
endif
# pip keeps an installed torch that meets the pin, whatever index it came from: a newly named index
# (the CPU build's for a CUDA one) takes effect only once the venv's torch is removed.
ifneq ($(call recorded,TORCH_INDEX_URL),$(TORCH_INDEX_URL))
INDEX_CHANGED := yes
endif
else ifneq ($(wildcard $(BIN)/python),)
# A venv set up before SETUP_INPUTS existed holds whatever its first run named: installed again only
# when this run names TORCH or an index, so a plain `make test` on it stays as quick as before.
SETUP_CHANGED := $(call given,TORCH)$(call given,TORCH_INDEX_URL)
INDEX_CHANGED := $(call given,TORCH_INDEX_URL)
endif
# A venv keeps the Python that made it: a PY named for an existing .venv must be that Python's
# version, or the run stops here, before any install, rather than go on with the other one. Its
# version, not its name, is compared: PY=python3 for the python3.11 that made the venv is the same.
ifneq ($(call given,PY),)
ifneq ($(wildcard $(BIN)/python),)
ifeq ($(filter clean,$(MAKECMDGOALS)),)
version = $(shell $(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
PY_VERSION := $(call version,$(PY))
VENV_VERSION := $(call version,$(BIN)/python)
ifeq ($(PY_VERSION),)
$(error PY=$(PY) does not run here)
endif
ifneq ($(PY_VERSION),$(VENV_VERSION))
$(error $(VENV) has Python $(VENV_VERSION), not PY=$(PY) ($(PY_VERSION)), and a venv cannot change its Python: remove $(VENV) (make clean) and run make again)
endif
endif
endif
endif

.PHONY: demo test bench setup clean FORCE

$(STAMP): pyproject.toml $(if $(SETUP_CHANGED),FORCE)
	@# One version, as the installs below pin it twice and the last line checks it: a range such as
	@# torch>=2.5,<2.15 failed that check with an IndexError, after the whole install.
	@case "$(TORCH)" in torch==*[!0-9A-Za-z.+]* | torch==) ;; torch==*) exit 0;; esac; \
	  echo "TORCH=$(TORCH): name one version, as TORCH=torch==2.13.0" >&2; exit 1
	@# An install that stops halfway (say, torch removed for a new index, and the index unreachable)
	@# leaves no stamp: a run that then names the old inputs again must not take the venv as set up.
	@rm -f $(STAMP)
	@# python3 stands in where the default $(PY) is missing, never for a PY that was named: that one is
	@# the Python wanted, and another in its place went unnoticed.
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) $(if $(call given,PY),,|| python3 -m venv $(VENV))
	@# A Python elastic does not run on is said plainly, not as pip's requires-python resolver error.
	@$(BIN)/python -c "import sys; sys.exit(0 if sys.version_info[:2] in ((3, 11), (3, 12)) else 'elastic needs Python 3.11 or 3.12; $(VENV) has ' + sys.version.split()[0] + ': remove $(VENV) and run make again with PY=python3.12 (or python3.11)')"
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned to $(TORCH), from TORCH_INDEX_URL if set; pyproject states the supported range.
	$(if $(INDEX_CHANGED),$(BIN)/python -m pip uninstall --quiet --quiet --yes torch)
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)")
	# The pin again: pip's resolver, backtracking over s3fs/fsspec and ray versions, otherwise
	# drops the installed torch for the newest one the index has (a multi-GB CUDA build).
	# One venv for test, demo and bench: the bench extra adds Ray Train, which benchmarks/ compare with.
	$(BIN)/python -m pip install --quiet -e ".[test,bench]" "$(TORCH)"
	$(BIN)/python -c "import torch, sys; v, pin = torch.__version__, '$(TORCH)'.split('==')[1]; sys.exit(0 if pin in (v, v.split('+')[0]) else 'setup installed torch ' + v + ', not $(TORCH)')"
	@printf '%s\n' "TORCH=$(TORCH)" "TORCH_INDEX_URL=$(TORCH_INDEX_URL)" > $(SETUP_INPUTS)
	@touch $(STAMP)

FORCE:

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/digits.py

test: $(STAMP)
	# The slowest tests are listed at the end: the suite should stay under 10 minutes on 2 cores.
	# Two pytest processes (one per core here, at most 4 elsewhere), each given whole modules
	# (--dist loadfile), so a module still starts one Ray cluster: the e2e tests spend much of
	# their time waiting (heartbeat and step timeouts, outages, stops), which the other process
	# fills. On the 2-vCPU VM: 1145 s serial, 755-994 s this way (2026-11-26), 1124-1320 s
	# (2026-11-27, 514-713 tests), over the 10 minutes it should take. Where it goes: ~190 worker
	# processes each spend ~5.8 s of CPU before training (import torch 2.5 s, and torch._dynamo
	# 2.35 s, which Optimizer.__init__ imports through torch._disable_dynamo; every optimizer's
	# step and DDP's constructor use it too), 1090 s of CPU in all, with the two cores ~95% busy.
	# The heaviest modules go first (tests/conftest.py HEAVY_FIRST), so none runs alone at the end:
	# 646 s before, 582 s after, back to back on the same VM (2026-11-27); 627 s with 784 tests that evening.
	# --no-loadscope-reorder keeps that order: pytest-xdist 3.8 otherwise hands out modules by their
	# number of tests, so the few-test e2e modules (jobs, node loss, buffers) went last and the jobs
	# test ran alone for its last ~30 s (637 s and 597 s, 2026-11-27). Per-test CPU, measured serially
	# (2026-11-27): 1013 CPU-s in all, a ~507 s floor on two cores; -n 3 took 683 s against 637 s.
	# 2026-11-28: 588-695 s from run to run (824-846 tests), the same code taking 588 s and 656 s;
	# 568-715 s that night (849-881 tests). Per test (CPU from /proc/stat, serially): 4-22 CPU-s
	# for an e2e test, nearly all of it worker processes starting (torch 1.25 s, torch._dynamo
	# 1.1-1.4 s, the model ~0.3 s; our modules ~0.4 s), and 5.3 CPU-s for a Ray cluster start.
	# Bytecode for this checkout first: where PYTHONDONTWRITEBYTECODE is set (this VM sets it), every
	# process (~460 Ray actors a run) compiled the package from source, ~0.15 s of CPU each.
	# -q prints only what fails to compile (file, line, the SyntaxError): sent to /dev/null, a typo
	# stopped make with no word of where.
	$(BIN)/python -m compileall -q elastic tests examples
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=15 tests

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/checkpoint_overhead.py
	$(BIN)/python benchmarks/snapshot_cost.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/straggler.py

clean:
	rm -rf $(VENV) .pytest_cache
