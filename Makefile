# `make demo` sets up .venv and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup demo test test-fast bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# What the demo needs: the pinned runtime set and Kiln itself.
$(RUN_STAMP): pyproject.toml requirements.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

# The tests and benchmarks add pytest, Accelerate, matplotlib and DeepSpeed.
$(DEV_STAMP): $(RUN_STAMP) requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

setup: $(DEV_STAMP)

demo: $(RUN_STAMP)
	$(PY) examples/train_lm.py

test: $(DEV_STAMP)
	$(PY) -m pytest tests -q

test-fast: $(DEV_STAMP)
	$(PY) -m pytest tests -q -m "not inductor"

# Every benchmark result committed under benchmarks/results (the CPU ones; about 37 minutes on 2 cores).
bench: $(DEV_STAMP)
	$(VENV)/bin/kiln bench --out benchmarks/results --name kiln_bench_cpu
	$(VENV)/bin/kiln bench --models small --methods eager,full,regional,accelerate-regional --batch-sizes 4 \
		--repeat 3 --out benchmarks/results --name kiln_bench_cpu_repeat3
	$(VENV)/bin/kiln bench --plan warm-start --out benchmarks/results --name kiln_bench_warm_start_cpu
	$(VENV)/bin/kiln bench --plan warm-start --variants cold,warm,cold-precompile,warm-precompiled,warm-precompiled-copy \
		--out benchmarks/results --name kiln_bench_precompiled_cpu
	$(VENV)/bin/kiln bench --plan startup --out benchmarks/results --name kiln_bench_startup_cpu
	$(VENV)/bin/kiln bench --plan local-processes --out benchmarks/results --name kiln_bench_local_processes_cpu
	$(VENV)/bin/kiln bench --plan buckets --out benchmarks/results --name kiln_bench_buckets_cpu

clean:
	rm -rf $(VENV) build *.egg-info
