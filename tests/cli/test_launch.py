import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kiln.cli import main
from kiln.cli.config import ask
from kiln.cli.launch import build_command
from kiln.cli.settings import load_config_file, process_environment, resolve
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "launch_probe.py"


def kiln(*args, timeout=300, **popen):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_COMPILE_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    env["KILN_CONFIG_FILE"] = "/nonexistent/kiln.yaml"  # never the user's own default file
    return subprocess.run([sys.executable, "-m", "kiln", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, **popen)


def test_flags_win_over_the_file_which_wins_over_defaults(tmp_path):
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({"num_processes": 4, "mixed_precision": "bf16", "dynamo_backend": "eager"}))
    settings = resolve({"mixed_precision": "fp16"}, load_config_file(path))
    assert (settings["num_processes"], settings["mixed_precision"], settings["dynamo_backend"]) == (4, "fp16", "eager")
    assert settings["num_machines"] == 1  # default
    env = process_environment(settings)
    assert env == {"KILN_MIXED_PRECISION": "fp16", "KILN_DYNAMO_BACKEND": "eager"}


@pytest.mark.parametrize("content, message", [
    ({"num_procs": 2}, "unknown setting"),
    ({"mixed_precision": "fp4"}, "mixed_precision: 'fp4' is not one of"),
    ({"dynamo_use_fullgraph": "maybe"}, "not a boolean"),
    ({"num_processes": 3, "num_machines": 2}, "does not split evenly"),
])
def test_bad_config_files_are_named_errors(tmp_path, content, message):
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(ValueError, match=message):
        resolve({}, load_config_file(path))


def test_commands_for_one_process_one_machine_and_many():
    one = resolve({}, {})
    assert build_command(one, "train.py", ["--x"]) == [sys.executable, "train.py", "--x"]
    two = resolve({"num_processes": 4, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
                   "main_process_port": 29501}, {})
    assert build_command(two, "train.py", []) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=2", "--node_rank=1",
        "--master_addr=10.0.0.1", "--master_port=29501", "train.py"]


def test_restarts_run_even_one_process_under_torchrun():
    restarted = resolve({"max_restarts": 2}, {})
    command = build_command(restarted, "train.py", [])
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--max_restarts=2" in command
    assert "--nproc_per_node=1" in command and command[-1] == "train.py"
    with pytest.raises(ValueError, match="must be 0 or more"):
        resolve({"max_restarts": -1}, {})
    with pytest.raises(ValueError, match="max_restarts works on one machine"):
        resolve({"max_restarts": 1, "num_machines": 2, "num_processes": 2}, {})


def test_config_writes_what_launch_reads(tmp_path):
    path = tmp_path / "kiln.yaml"
    assert main(["config", "--config_file", str(path), "--num_processes", "2", "--distributed_type", "fsdp",
                 "--mixed_precision", "bf16", "--dynamo_backend", "aot_eager",
                 "--dynamo_use_regional_compilation", "true"]) == 0
    settings = load_config_file(path)
    assert settings["distributed_type"] == "fsdp" and settings["dynamo_use_regional_compilation"] is True


def test_deepspeed_settings_need_distributed_type_deepspeed(tmp_path):
    with pytest.raises(ValueError, match="zero_stage is a deepspeed setting"):
        resolve({"zero_stage": 3}, {"distributed_type": "fsdp"})
    with pytest.raises(ValueError, match="ZeRO stage"):
        resolve({"zero_stage": 5, "distributed_type": "deepspeed"}, {})
    with pytest.raises(ValueError, match="no DeepSpeed config file"):
        resolve({"deepspeed_config_file": str(tmp_path / "missing.json"), "distributed_type": "deepspeed"}, {})
    (tmp_path / "ds.json").write_text("{}")
    settings = resolve({"distributed_type": "deepspeed", "zero_stage": "3", "gradient_clipping": "1.0",
                        "deepspeed_config_file": str(tmp_path / "ds.json")}, {})
    env = process_environment(settings)
    assert env["KILN_DISTRIBUTED_TYPE"] == "deepspeed" and env["KILN_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["KILN_DEEPSPEED_GRADIENT_CLIPPING"] == "1.0"
    assert env["KILN_DEEPSPEED_CONFIG_FILE"] == str((tmp_path / "ds.json").resolve())


def test_config_asks_deepspeed_questions_only_for_deepspeed():
    asked = []

    def prompt(text):
        asked.append(text)
        return {"distributed_type": "deepspeed", "zero_stage": "3"}.get(text.split("[")[1].split(",")[0], "")

    assert ask(prompt) == {"distributed_type": "deepspeed", "zero_stage": 3}
    assert any("zero_stage" in text for text in asked)
    asked.clear()
    ask(lambda text: asked.append(text) or "")
    assert not any("zero_stage" in text for text in asked)


def test_config_asks_when_run_without_flags():
    answers = iter(["2", "", "", "", "", "nonsense", "fsdp"] + [""] * 20)
    settings = ask(lambda prompt: next(answers))
    assert settings == {"num_processes": 2, "distributed_type": "fsdp"}  # the bad answer was asked again


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_every_setting_reaches_every_process(tmp_path, strategy):
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    settings = {"num_processes": 2, "mixed_precision": "bf16", "dynamo_backend": "aot_eager",
                "dynamo_use_regional_compilation": True, "distributed_type": strategy}
    if strategy == "deepspeed":  # the settings Accelerate's DeepSpeed launcher drops
        (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": "auto"}}))
        settings.update(zero_stage=3, deepspeed_config_file=str(tmp_path / "ds.json"))
    config = tmp_path / "kiln.yaml"
    config.write_text(yaml.safe_dump(settings))
    done = kiln("launch", "--config_file", str(config), "--main_process_port", str(free_port()),
                str(PROBE), "report", str(tmp_path / "seen"))
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads((tmp_path / f"seen.{rank}").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert (record["rank"], record["world"], record["type"], record["precision"]) == \
            (rank, 2, strategy.upper(), "bf16")
        assert record["dynamo"] == "aot_eager"
        assert record["env"]["KILN_DYNAMO_USE_REGIONAL_COMPILATION"] == "true"
        assert record["zero_stage"] == (3 if strategy == "deepspeed" else None)


@pytest.mark.multiprocess
def test_a_dead_rank_makes_the_launch_fail_in_bounded_time(tmp_path):
    start = time.monotonic()
    done = kiln("launch", "--num_processes", "2", "--main_process_port", str(free_port()),
                "--process_group_timeout", "30", str(PROBE), "die", str(tmp_path / "x"), timeout=180)
    assert done.returncode != 0
    assert time.monotonic() - start < 120


@pytest.mark.multiprocess
def test_two_machines_simulated_on_one_host_train_to_the_end(tmp_path):
    port = str(free_port())
    worker = ROOT / "tests/distributed/train_worker.py"
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_COMPILE_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    machines = [subprocess.Popen(
        [sys.executable, "-m", "kiln", "launch", "--num_machines", "2", "--machine_rank", str(rank),
         "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", port,
         str(worker), "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)]
    codes = [m.wait(timeout=300) for m in machines]
    assert codes == [0, 0], [m.stderr.read()[-3000:] for m in machines]
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and len(result["losses"]) == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [["ddp"], ["fsdp"], ["deepspeed", "--zero_stage", "3", "--gradient_clipping", "1"]],
                         ids=["ddp", "fsdp", "deepspeed"])
def test_the_demo_runs_unchanged_under_kiln_launch(tmp_path, strategy):
    if strategy[0] == "deepspeed":
        pytest.importorskip("deepspeed")
    done = kiln("launch", "--num_processes", "2", "--distributed_type", *strategy, "--main_process_port",
                str(free_port()), str(ROOT / "examples/train_lm.py"), "--backend", "aot_eager", "--steps", "4",
                "--log-every", "2", "--layers", "2", "--width", "32", "--batch", "4", "--seq", "32",
                "--out", str(tmp_path / "weights"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "step    4/4" in done.stdout and "GPT2Block" in done.stdout
    assert (tmp_path / "weights/model.safetensors").is_file()


def test_env_prints_versions():
    done = kiln("env")
    assert done.returncode == 0 and "torch" in done.stdout and "python" in done.stdout


def test_launch_with_a_missing_script_is_a_clear_error(tmp_path):
    done = kiln("launch", str(tmp_path / "nope.py"))
    assert done.returncode == 2 and "no script at" in done.stderr
