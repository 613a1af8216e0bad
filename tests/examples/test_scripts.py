"""The scripts users run: the demo and an Accelerate-style script, each in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]


def _run(args, cwd, **extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_COMPILE_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra_env)
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_accelerate_style_script_runs_with_changed_imports_only(tmp_path):
    out = _run([str(ROOT / "tests/examples/accelerate_style_script.py")], tmp_path)
    match = re.search(r"distributed_type=DistributedType.NO processes=1 device=\S+ first=([\d.]+) last=([\d.]+)", out)
    assert match, out
    assert float(match.group(2)) < float(match.group(1))
    assert (tmp_path / "out/accelerate_style/model.safetensors").is_file()


def test_demo_trains_and_reports_compiled_blocks(tmp_path):
    out = _run([str(ROOT / "examples/train_lm.py"), "--backend", "aot_eager", "--steps", "12",
                "--log-every", "4", "--out", str(tmp_path / "weights")], tmp_path)
    assert "step   12/12" in out
    first, last = map(float, re.search(r"loss\s+([\d.]+) first, ([\d.]+) last", out).groups())
    assert last < first
    assert re.search(r"compiled region  GPT2Block: 4 instance\(s\) share 1 graph\(s\), ran compiled \d+ times", out)
    assert "never ran compiled code" not in out
    with safe_open(str(tmp_path / "weights/model.safetensors"), framework="pt") as handle:
        assert "transformer.h.0.attn.c_attn.weight" in handle.keys()


@pytest.mark.inductor
@pytest.mark.warm_starts
def test_demo_with_inductor_in_bf16_starts_warm_the_second_time(tmp_path):
    args = [str(ROOT / "examples/train_lm.py"), "--steps", "4", "--log-every", "2", "--layers", "2",
            "--width", "64", "--batch", "4", "--seq", "32", "--precision", "bf16", "--out", str(tmp_path / "weights")]
    cache = str(tmp_path / "cache")
    cold = _run(args, tmp_path, KILN_COMPILE_CACHE_DIR=cache)
    assert re.search(r"compiled region  GPT2Block: 2 instance\(s\) share 1 graph\(s\), ran compiled 16 times", cold), cold
    assert "warm-start cache: hits 0, misses 1, saves 1" in cold
    warm = _run(args, tmp_path, KILN_COMPILE_CACHE_DIR=cache)
    assert "warm-start cache: hits 1, misses 0" in warm, warm




def test_demo_second_run_with_precompile_starts_without_any_dynamo_trace(tmp_path):
    args = [str(ROOT / "examples/train_lm.py"), "--backend", "aot_eager", "--steps", "3", "--log-every", "3",
            "--layers", "2", "--width", "64", "--batch", "4", "--seq", "32", "--precompile",
            "--out", str(tmp_path / "weights")]
    cache = str(tmp_path / "cache")
    cold = _run(args, tmp_path, KILN_COMPILE_CACHE_DIR=cache)
    assert re.search(r"GPT2Block: 2 instance\(s\) share 1 graph\(s\), ran compiled \d+ times "
                     r"\(precompiled, 1 Dynamo trace\(s\) in this run\)", cold), cold
    warm = _run(args, tmp_path, KILN_COMPILE_CACHE_DIR=cache)
    assert re.search(r"GPT2Block: 2 instance\(s\) share 1 graph\(s\), ran compiled \d+ times "
                     r"\(precompiled, 0 Dynamo trace\(s\) in this run, 1 precompiled artifact\(s\) loaded", warm), warm
    loss = r"loss\s+([\d.]+) first, ([\d.]+) last"
    assert re.search(loss, cold).groups() == re.search(loss, warm).groups()
