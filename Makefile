# `make demo` sets up .venv and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup demo test test-fast test-warm-starts test-long-launches test-bench test-accelerate-examples test-torch-matrix matrix-downloads latest-downloads test-latest bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# What the demo needs: the pinned runtime set and Kiln itself.
$(RUN_STAMP): pyproject.toml requirements.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

# The tests and benchmarks add pytest, Accelerate, matplotlib and DeepSpeed. DeepSpeed's CPU
# shared-memory op is built here (g++, about a minute, cached in ~/.cache/torch_extensions) rather
# than inside the first DeepSpeed test.
$(DEV_STAMP): $(RUN_STAMP) requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
	touch $@

setup: $(DEV_STAMP)

demo: $(RUN_STAMP)
	$(PY) examples/train_lm.py

# Parallel workers, one per core (at most 4), each taking whole modules (--dist loadscope), so a
# module fixture (a shared launch) is made once; modules go out longest first (tests/conftest.py
# orders them; --no-loadscope-reorder keeps xdist from reordering them by test count). The serial tests (they need the machine to
# themselves) run afterwards, alone.
WORKERS ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
PYTEST_PARALLEL := $(PY) -m pytest tests -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder

LANES := not accelerate_examples and not latest and not bench_runs and not warm_starts and not long_launches

test: $(DEV_STAMP)
	$(PYTEST_PARALLEL) -m "not serial and $(LANES)"
	$(PY) -m pytest tests -q -m "serial and $(LANES)"

# Whole jobs with real Inductor in fresh processes, cold then warm (marker warm_starts): the demo's
# second run in bf16, a saved compile loaded by a second process, training on the helpers' caches,
# damaged and foreign compiled code in a cache folder and a checkpoint, and the outer graph's gradients
# (compiled here, and compiled by a helper into the caches). Each compiles cold with gcc (20-50 s
# here); together they would take make test past its 12 minutes. make test keeps one real Inductor
# parity test (tests/compile/test_inductor.py); CI runs these after make test (.ci/run).
test-warm-starts: $(DEV_STAMP)
	$(PYTEST_PARALLEL) -m "warm_starts and not serial"

# The five longest tests of the default suite (marker long_launches, 20-50 s each on 2 cores: tensor
# parallel inside FSDP2 with its resumes, fp8 under FSDP2 and under tensor parallel, DeepSpeed ZeRO-3's
# universal-checkpoint resume, the Stable Diffusion UNet with its resnets as regions): about 75 s of
# make test's wall time, which they would take past its 12 minutes; CI runs them after make test.
test-long-launches: $(DEV_STAMP)
	$(PYTEST_PARALLEL) -m "long_launches and not serial"

# kiln bench's real rows (tests/cli/test_bench_rows.py, test_bench_warm_start.py): whole bench runs
# in child processes, cold and warm starts with Inductor, a launch. They test the benchmark tool, not
# training, and would not fit make test's 12 minutes; CI runs them after make test (.ci/run).
test-bench: $(DEV_STAMP)
	$(PYTEST_PARALLEL) -m "bench_runs and not serial"

# The inner loop: no real Inductor compile, no launch (about 2 minutes on 2 cores).
test-fast: $(DEV_STAMP)
	$(PYTEST_PARALLEL) -m "not inductor and not multiprocess and not serial and $(LANES)"

# Whole example scripts in fresh processes: Accelerate's own, each run with the real Accelerate and
# on Kiln (1 and 2 processes, regional compile: 75 runs), then Kiln's three scripts in the shape of
# transformers' Accelerate examples (tests/examples/test_accelerate_scripts.py: 9 runs, stopped and
# resumed), two at a time, on their own (10-15 minutes on idle cores, 25 on busy ones: they would
# not fit make test's time). CI runs it after make test (.ci/run).
ACCELERATE_EXAMPLE_TESTS := tests/accelerate_examples tests/examples/test_accelerate_scripts.py

test-accelerate-examples: $(DEV_STAMP)
	$(PY) -m pytest $(ACCELERATE_EXAMPLE_TESTS) -q -p no:xdist -m accelerate_examples

# The torch matrix (.ci/run): the start-up, compile, accelerator and checkpoint tests on the other
# torch versions Kiln supports, each in a virtual environment of its own. Any torch but the pinned
# 2.13.0 comes from the package index as a CUDA build (about 4.6 GB, 2 minutes); it runs on the CPU.
# Tests that need an API a version lacks assert its fallback there (tests/torch_features.py). Without
# the real-Inductor tests (marker inductor, and the warm-starts lane's): what differs between torch
# versions is Dynamo's and AOTAutograd's APIs, which aot_eager reaches; gcc's compiles made the lane
# 12 minutes a version here (one outer-graph test 290 s on torch 2.11), more than CI's time allows.
MATRIX_TORCHES ?= 2.11.0 2.14.1
MATRIX_TESTS := tests/compile tests/test_accelerator.py tests/test_plugins.py tests/checkpoint
MATRIX_MARKERS := not multiprocess and not inductor and not warm_starts

# Two steps: the downloads (.deps), which .ci/run lets run beside the tests, and Kiln itself (an
# editable install writes into the checkout, which test_packaging builds from: never both at once).
.venv-torch-%/.deps: requirements-base.txt requirements-matrix.txt
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-torch-$*/bin/python -m pip install --quiet torch==$* -r requirements-matrix.txt
	touch $@

.venv-torch-%/.installed: .venv-torch-%/.deps pyproject.toml
	.venv-torch-$*/bin/python -m pip install --quiet --no-deps -e .
	touch $@

# Kept between runs: make would otherwise delete them as intermediate files of the pattern rules.
.PRECIOUS: .venv-torch-%/.deps .venv-torch-%/.installed

test-torch-%: .venv-torch-%/.installed
	.venv-torch-$*/bin/python -m pytest $(MATRIX_TESTS) -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder \
		-m "$(MATRIX_MARKERS) and not serial"
	.venv-torch-$*/bin/python -m pytest $(MATRIX_TESTS) -q -m "$(MATRIX_MARKERS) and serial"

test-torch-matrix: $(addprefix test-torch-,$(MATRIX_TORCHES))

# The matrix's downloads alone (.ci/run runs them while the first lanes run).
matrix-downloads: $(addprefix .venv-torch-,$(addsuffix /.deps,$(MATRIX_TORCHES)))

# What users install (.ci/run, after the pinned suite): the pinned torch and the newest release of each
# integration library (requirements-latest.txt, upgraded at every run), on the tests that touch them:
# compile, accelerator, checkpoint, integrations, fp8, DeepSpeed's single-process tests. Real Inductor
# only in the tests marked `latest` (the kernelized Llama's precompiled regions, which make test
# leaves to this lane; its aot_eager twin runs in make test); no launches (4 minutes on 2 cores, the
# install included, when nothing new was released).
LATEST_VENV := .venv-latest
LATEST_TESTS := tests/compile tests/test_accelerator.py tests/test_plugins.py tests/test_accelerate_api.py \
	tests/checkpoint tests/integrations tests/test_fp8.py tests/parallel/test_deepspeed.py
LATEST_MARKERS := not multiprocess and not serial and (not inductor or latest)

latest-downloads:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -r requirements-latest.txt

# The tests marked `latest` always run here (nowhere else); the others only where a release differs
# from the pinned one (tests/latest_selection.py: every test when transformers, Accelerate, torch or
# numpy moved, the files that reach peft, diffusers, torchao, DeepSpeed or torchdata when only they did).
test-latest: latest-downloads $(DEV_STAMP)
	$(LATEST_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(PY) -m pip list --format freeze > $(LATEST_VENV)/pinned.txt 2>/dev/null
	$(LATEST_VENV)/bin/python -m pip list --format freeze > $(LATEST_VENV)/latest.txt 2>/dev/null
	$(LATEST_VENV)/bin/python -m pytest $(LATEST_TESTS) -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder \
		-m "$(LATEST_MARKERS) and latest"
	@selected="$$($(LATEST_VENV)/bin/python tests/latest_selection.py $(LATEST_VENV)/pinned.txt \
		$(LATEST_VENV)/latest.txt $(LATEST_TESTS))" || exit 1; \
	if [ -z "$$selected" ]; then echo "test-latest: make test ran the rest on these releases"; else \
		$(LATEST_VENV)/bin/python -m pytest $$selected -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder \
			-m "$(LATEST_MARKERS) and not latest"; fi

# Every benchmark result committed under benchmarks/results (the CPU ones; about 54 minutes on 2 cores).
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
	$(VENV)/bin/kiln bench --plan checkpointing --out benchmarks/results --name kiln_bench_checkpointing_cpu
	$(VENV)/bin/kiln bench --plan host-overhead --out benchmarks/results --name kiln_bench_host_overhead_cpu
	$(VENV)/bin/kiln bench --plan outer-graph --out benchmarks/results --name kiln_bench_outer_graph_cpu
	$(VENV)/bin/kiln bench --plan nd-parallel --out benchmarks/results --name kiln_bench_nd_parallel_cpu
	$(VENV)/bin/kiln bench --plan diffusion --backend aot_eager --out benchmarks/results --name kiln_bench_diffusion_aot_eager_cpu
	$(VENV)/bin/kiln bench --plan diffusion --out benchmarks/results --name kiln_bench_diffusion_cpu

clean:
	rm -rf $(VENV) $(LATEST_VENV) build *.egg-info
