"""ParallelismConfig with Accelerate's fields, names and checks; what Kiln does not do yet
(sequence parallelism) is refused by name. HSDP, tensor and context parallelism run in
tests/distributed/test_strategies.py (four processes)."""

import json

import pytest

from kiln import Accelerator, ParallelismConfig
from kiln.cli.settings import load_config_file, process_environment, resolve
from kiln.parallel.parallelism_config import from_environment
from kiln.utils import FullyShardedDataParallelPlugin, TorchContextParallelConfig


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("PARALLELISM_CONFIG_") or n == "KILN_USE_PARALLELISM_CONFIG"]:
        monkeypatch.delenv(name)


def test_hsdp_sizes_give_accelerates_dimension_names():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=4)
    assert (config.total_size, config.data_parallel_size, config.non_data_parallel_size) == (8, 8, 1)
    assert config.dp_dim_names == ["dp_replicate", "dp_shard"] and config.non_dp_dim_names == []
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert config.dp_shard_cp_dim_names == ["dp_shard"] and config.dp_cp_dim_names == ["dp_replicate", "dp_shard"]
    assert config.dp_replicate_enabled and config.dp_shard_enabled and not config.tp_enabled
    assert config.to_json()["dp_shard_size"] == 4
    assert ParallelismConfig(dp_shard_size=2).fsdp_dim_names == ["dp_shard_cp"]


def test_sizes_left_unset_come_from_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    assert from_environment() is None  # the sizes alone do not ask for a config
    monkeypatch.setenv("KILN_USE_PARALLELISM_CONFIG", "true")
    config = from_environment()
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (1, 2, 1)


@pytest.mark.parametrize("fields, error, message", [
    ({"dp_shard_size": 0}, ValueError, "dp_shard_size must be a whole number of at least 1"),
    ({"cp_size": 2, "sp_size": 2}, ValueError, "exclude each other"),
    ({"cp_size": 2, "dp_replicate_size": 2}, ValueError, "pure replication"),
    ({"cp_backend": "ring"}, ValueError, "cp_backend must be 'torch'"),
    ({"cp_size": 2, "cp_handler": {"cp_comm_strategy": "alltoall"}}, TypeError, "must be a TorchContextParallelConfig"),
])
def test_invalid_combinations_fail_at_construction(fields, error, message):
    with pytest.raises(error, match=message):
        ParallelismConfig(**fields)


@pytest.mark.parametrize("fields, processes, strategy, message", [
    ({"tp_size": 2}, 2, "fsdp", "FSDP2 has nothing to shard over: the processes are all tensor-parallel"),
    ({"tp_size": 2, "dp_replicate_size": 2}, 4, "ddp", "needs dp_shard_size > 1"),
    ({"tp_size": 2}, 2, "deepspeed", "does not compose with DeepSpeed"),
    ({"sp_size": 2}, 2, "fsdp", "sequence parallelism .* is not supported"),
    ({"cp_size": 2}, 2, "ddp", r"context parallelism \(cp_size=2\) trains under FSDP2"),
    ({"cp_size": 2, "tp_size": 2}, 4, "deepspeed", "FSDP2"),
    ({"dp_shard_size": 2}, 4, "fsdp", "multiply to 2 .* 4 processes"),
    ({"dp_shard_size": 2}, 2, "ddp", "pass fsdp_plugin=FullyShardedDataParallelPlugin"),
    ({"dp_replicate_size": 2}, 2, "fsdp", "FSDP2 has no dimension to shard over"),
    ({"dp_shard_size": 2}, 2, "deepspeed", "FSDP2"),
])
def test_a_config_that_does_not_fit_the_job_is_refused_naming_the_fix(fields, processes, strategy, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        ParallelismConfig(**fields).fit_to(processes, strategy)


@pytest.mark.parametrize("fields, processes", [({"cp_size": 2}, 2), ({"cp_size": 2, "dp_shard_size": 2}, 4),
                                               ({"cp_size": 2, "tp_size": 2}, 4)])
def test_context_parallel_layouts_fit_fsdp2_and_shard_over_dp_shard_cp(fields, processes):
    config = ParallelismConfig(**fields)
    config.fit_to(processes, "fsdp")
    assert config.fsdp_dim_names == ["dp_shard_cp"] and "cp" in config.non_dp_dim_names
    assert config.cp_handler.cp_comm_strategy == "allgather"
    assert json.loads(json.dumps(config.to_json()))["cp_handler"] == {"cp_comm_strategy": "allgather"}


def test_the_context_parallel_comm_strategy_is_accelerates_and_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "alltoall"
    with pytest.raises(ValueError, match="cp_comm_strategy must be one of allgather, alltoall, not 'ring'"):
        TorchContextParallelConfig(cp_comm_strategy="ring")


def test_sizes_of_one_become_data_parallelism_over_every_process():
    config = ParallelismConfig()
    config.fit_to(4, "ddp")
    assert config.dp_replicate_size == 4 and config.dp_dim_names == ["dp_replicate"]


def test_the_accelerator_holds_the_config_and_refuses_what_kiln_does_not_do():
    accelerator = Accelerator(parallelism_config=ParallelismConfig())
    assert accelerator.parallelism_config.total_size == 1 and accelerator.torch_device_mesh is None
    assert (accelerator.data_parallel_rank, accelerator.data_parallel_shard_rank) == (0, 0)
    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        Accelerator(parallelism_config=ParallelismConfig(sp_size=2))
    with pytest.raises(ValueError, match="multiply to 2 .* 1 processes"):
        Accelerator(parallelism_config=ParallelismConfig(cp_size=2), fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(TypeError, match="kiln ParallelismConfig"):
        Accelerator(parallelism_config={"dp_shard_size": 2})


def test_launch_settings_take_accelerates_parallelism_config_section(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("distributed_type: fsdp\nnum_processes: 4\nparallelism_config:\n"
                      "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n")
    env = process_environment(resolve({}, load_config_file(config)))
    assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2" and env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"
    assert env["KILN_USE_PARALLELISM_CONFIG"] == "true"
