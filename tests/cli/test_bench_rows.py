"""`kiln bench` rows run for real: each in a child process (or, for the diffusion rows, in this one)
with backend aot_eager on the tiny model, read back from the files the run writes."""

import os
import subprocess
import sys

import pytest
import torch

from bench_helpers import HAVE_ACCELERATE, ROOT, TINY, read_jsonl
from kiln.bench.plan import build_rows
from kiln.cli import main

# A row a few seconds (subprocesses orders the modules: tests/conftest.py); make test-bench runs them.
pytestmark = [pytest.mark.subprocesses, pytest.mark.bench_runs]


def test_bench_measures_eager_and_regional_and_writes_json_lines_and_table(tmp_path, capsys):
    status = main(["bench", *TINY, "--methods", "eager,regional", "--workloads", "infer", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "[1/2] eager tiny infer b2 ..." in out and "[2/2] regional tiny infer b2 ..." in out
    rows = read_jsonl(tmp_path / "kiln_bench_tiny.jsonl")
    assert [r["method"] for r in rows] == ["eager", "regional"]
    regional = rows[1]
    assert "error" not in regional
    assert regional["kiln_compiled_calls"] > 0 and regional["compiled_frames_per_step"] == 4  # 4 layers
    assert regional["kiln_regions"] == ["LlamaDecoderLayer"] and regional["kiln_instances"] == 4
    assert regional["compile_s"] > 0 and regional["steady_ms"] > 0 and regional["peak_mib"] > 0
    assert rows[0]["compiled_frames_per_step"] == 0
    table = (tmp_path / "kiln_bench_tiny.md").read_text()
    assert "| model | workload | batch x seq | method | compile s |" in table
    assert "| tiny | infer | 2 x 32 | eager |" in table and "| 1.00x |" in table
    assert out.rstrip().endswith(table.rstrip().splitlines()[-1])  # the table (and targets) print last


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed")
def test_bench_runs_accelerate_regional_compile_through_its_accelerator(tmp_path, capsys):
    status = main(["bench", *TINY, "--methods", "accelerate-regional", "--workloads", "train",
                   "--out", str(tmp_path)])
    assert status == 0, capsys.readouterr().out
    (row,) = read_jsonl(tmp_path / "kiln_bench_tiny.jsonl")
    assert row["accelerate"] and "error" not in row
    # Accelerate compiles each layer plus every other leaf (embedding, norm, rotary, head): 8 frames.
    assert row["compiled_frames_per_step"] >= 4 and row["dynamo_graphs"] >= 1


def test_gpu_script_runs_the_tiny_plan_on_cpu_and_writes_under_out(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_bench.sh"), *TINY, "--methods", "full", "--workloads", "infer"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = read_jsonl(tmp_path / "kiln_bench_tiny.jsonl")
    assert row["method"] == "full" and row["kiln_compiled_calls"] > 0 and row["device"] == "cpu"
    assert (tmp_path / "kiln_bench_tiny.md").is_file() and (tmp_path / "kiln_bench_env.txt").is_file()


def test_bucket_plan_counts_the_recompiles_that_buckets_remove(tmp_path, capsys):
    status = main(["bench", "--device", "cpu", "--plan", "buckets", "--models", "tiny", "--variants",
                   "static,static-buckets", "--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    static, bucketed = read_jsonl(tmp_path / "kiln_bench_buckets.jsonl")
    assert (static["variant"], bucketed["variant"], static["backend"]) == ("static", "static-buckets", "aot_eager")
    # Lengths 8-128 padded to each batch's longest give many shapes, a graph each, until Dynamo's
    # limit; padded to multiples of 32 there are at most 4.
    assert static["distinct_lengths"] > 4 >= bucketed["distinct_lengths"]
    assert static["graphs"] > bucketed["graphs"] and bucketed["eager_calls"] == 0
    assert static["compiled_calls"] > 0 and bucketed["compiled_calls"] > 0
    table = (tmp_path / "kiln_bench_buckets.md").read_text()
    assert "| static | False | none |" in table and "| static-buckets | False | multiple_of=32 |" in table


@pytest.mark.parametrize("model", ["sd-unet", "unet2d"])
def test_diffusion_rows_train_a_unet_with_every_block_call_compiled(model):
    pytest.importorskip("diffusers")
    from kiln.bench.diffusion import build_unet, make_unet_step
    from kiln.bench.measure import apply_method, kiln_facts

    (row,) = [r.as_dict() for r in build_rows("diffusion", device="cpu", backend="aot_eager", models=[model],
                                              methods=["regional"], seq=16)]
    unet, _, inputs = build_unet(row)
    before = [p.detach().clone() for p in unet.parameters()]
    step = make_unet_step(apply_method(unet, row), unet, inputs, row)
    step()
    step()
    facts = kiln_facts(unet)
    assert facts["kiln_compiled_calls"] > 0 and facts["kiln_eager_calls"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, unet.parameters()))  # AdamW stepped
