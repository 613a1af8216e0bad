"""The Accelerate names that real training scripts use (transformers' no_trainer examples, diffusers'
train_*.py, Accelerate's examples), on one process: each works as in Accelerate, or refuses at once."""

import datetime
import json
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import kiln
import kiln.state
import kiln.utils
from kiln import Accelerator
from kiln.optim import PreparedScheduler
from toy_models import Regressor


def test_every_name_scripts_import_is_there():
    for name in kiln.utils.__all__:
        assert getattr(kiln.utils, name) is not None, name
    for name in ("Accelerator", "AcceleratorState", "PartialState", "DistributedType", "skip_first_batches",
                 "find_executable_batch_size", "init_empty_weights", "init_on_device", "DistributedDataParallelKwargs",
                 "InitProcessGroupKwargs", "GradScalerKwargs", "AutocastKwargs", "ProfileKwargs",
                 "DataLoaderConfiguration", "DeepSpeedPlugin", "FullyShardedDataParallelPlugin",
                 "ProjectConfiguration"):
        assert hasattr(kiln, name), name
    from kiln.logging import get_logger  # noqa: F401
    assert kiln.DistributedType.MEGATRON_LM == "MEGATRON_LM"
    assert not hasattr(kiln.DistributedType, "TPU")  # gone from Accelerate since 1.0: scripts use XLA
    assert kiln.utils.PrecisionType.BF16 == "bf16" and kiln.utils.LoggerType.TENSORBOARD == "tensorboard"


def test_state_is_printable_and_shared():
    acc = Accelerator(mixed_precision="bf16")
    text = repr(acc.state)  # scripts log it: logger.info(accelerator.state, main_process_only=False)
    assert "Distributed environment: NO" in text and "Mixed precision type: bf16" in text
    assert kiln.AcceleratorState() is acc.state and kiln.PartialState() is acc.state
    assert kiln.state.is_initialized()
    assert acc.state.deepspeed_plugin is None and acc.state.fsdp_plugin is None
    assert acc.state.num_processes == 1 and acc.local_process_index == 0 and not acc.use_distributed


def test_accelerator_state_before_any_accelerator_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kiln.state, "_CURRENT", None)
    assert not kiln.state.is_initialized()
    with pytest.raises(RuntimeError, match="create the Accelerator first"):
        kiln.AcceleratorState()


def test_set_seed_device_specific_adds_the_process_index(monkeypatch):
    kiln.utils.set_seed(3)
    plain = torch.rand(1)
    monkeypatch.setenv("RANK", "1")
    kiln.utils.set_seed(2, device_specific=True)
    assert torch.equal(torch.rand(1), plain)


def forward_ran_under_autocast(acc, model):
    seen = []
    # a submodule: its hook runs inside the prepared forward (the model's own hooks run around it)
    model.body.register_forward_hook(lambda module, args, out: seen.append(torch.is_autocast_enabled("cpu")))
    model = acc.prepare(model)
    model(torch.randn(2, 3, 8))
    return seen[0]


@pytest.mark.parametrize("how", ["native_amp", "AutocastKwargs"])
def test_autocast_can_be_turned_off_before_prepare(how):
    if how == "native_amp":
        acc = Accelerator(mixed_precision="bf16")
        assert acc.native_amp
        acc.native_amp = False  # diffusers does this on Apple's MPS
    else:
        acc = Accelerator(mixed_precision="bf16", kwargs_handlers=[kiln.AutocastKwargs(enabled=False)])
    assert not acc.native_amp
    assert forward_ran_under_autocast(acc, Regressor()) is False
    assert forward_ran_under_autocast(Accelerator(mixed_precision="bf16"), Regressor()) is True
    with acc.autocast():
        assert not torch.is_autocast_enabled("cpu")
    on = Accelerator(mixed_precision="bf16")
    with on.autocast():
        assert torch.is_autocast_enabled("cpu")
        with on.autocast(autocast_handler=kiln.AutocastKwargs(enabled=False)):
            assert not torch.is_autocast_enabled("cpu")


def test_native_amp_cannot_change_after_prepare():
    acc = Accelerator(mixed_precision="bf16")
    acc.prepare(Regressor())
    with pytest.raises(ValueError, match="before the first prepare"):
        acc.native_amp = False


def test_grad_scaler_kwargs_reach_the_scaler():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[kiln.GradScalerKwargs(init_scale=1024.0,
                                                                                     growth_interval=7)])
    assert acc.scaler.get_scale() == 1024.0 and acc.scaler.get_growth_interval() == 7


def test_kwargs_handlers_refuse_unknown_and_repeated_kinds():
    with pytest.raises(TypeError, match="kwargs_handlers takes"):
        Accelerator(kwargs_handlers=[object()])
    with pytest.raises(ValueError, match="two AutocastKwargs"):
        Accelerator(kwargs_handlers=[kiln.AutocastKwargs(), kiln.AutocastKwargs(enabled=False)])
    assert kiln.DistributedDataParallelKwargs(find_unused_parameters=True).ddp_arguments() == \
        {"find_unused_parameters": True}
    assert kiln.InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=5)).to_kwargs() == \
        {"timeout": datetime.timedelta(seconds=5)}
    with pytest.raises(NotImplementedError, match="power_sgd"):
        kiln.DistributedDataParallelKwargs(comm_hook="power_sgd")


@pytest.mark.parametrize("argument, message", [
    ({"torch_tp_plugin": object()}, "pass parallelism_config=ParallelismConfig\(tp_size"),
    ({"megatron_lm_plugin": object()}, "Megatron-LM is not supported"),
    ({"rng_types": ["generator"]}, "rng_types is not supported"),
    ({"deepspeed_plugin": {"a": kiln.DeepSpeedPlugin()}}, "one DeepSpeedPlugin"),
])
def test_accelerate_arguments_kiln_does_not_take_refuse_at_once(argument, message):
    with pytest.raises(NotImplementedError, match=message):
        Accelerator(**argument)


def test_an_argument_accelerate_does_not_have_either_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'mixed_precison'"):
        Accelerator(mixed_precison="bf16")
    Accelerator(torch_tp_plugin=None, parallelism_config=None)  # Accelerate's defaults are fine


@pytest.mark.parametrize("name", ["MegatronLMDummyScheduler"])
def test_unsupported_helpers_fail_where_they_are_used(name):
    with pytest.raises(NotImplementedError, match=f"{name} is not supported by Kiln: .+"):
        getattr(kiln.utils, name)(torch.nn.Linear(2, 2).parameters())


def test_gradient_accumulation_plugin():
    acc = Accelerator(gradient_accumulation_plugin=kiln.utils.GradientAccumulationPlugin(num_steps=3))
    assert acc.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match="not both"):
        Accelerator(gradient_accumulation_steps=2,
                    gradient_accumulation_plugin=kiln.utils.GradientAccumulationPlugin(num_steps=2))


@pytest.mark.parametrize("sync_with_dataloader", [True, False])
def test_sync_with_dataloader_decides_whether_a_short_last_window_steps(sync_with_dataloader):
    plugin = kiln.utils.GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=sync_with_dataloader)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(3.0)), batch_size=1))
    syncs = []
    for _ in loader:
        with acc.accumulate():
            syncs.append(acc.sync_gradients)
    assert syncs == [False, True, sync_with_dataloader]


def test_sync_each_batch_never_skips_the_gradient_sync(monkeypatch):
    entered = []
    for each in (False, True):
        plugin = kiln.utils.GradientAccumulationPlugin(num_steps=2, sync_each_batch=each)
        acc = Accelerator(gradient_accumulation_plugin=plugin)
        model = acc.prepare(Regressor())
        monkeypatch.setattr(acc.strategy, "no_sync", lambda m, seen=entered, e=each: (seen.append(e), _null())[1])
        with acc.accumulate([model]):  # a list, as diffusers' LoRA scripts pass
            pass
    assert entered == [False]  # only without sync_each_batch was no_sync entered


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_accumulation_steps_and_sync_gradients_can_be_set():
    acc = Accelerator()
    acc.gradient_accumulation_steps = 4  # Accelerate's automatic_gradient_accumulation example does this
    assert acc.gradient_accumulation_steps == 4
    with pytest.raises(ValueError):
        acc.gradient_accumulation_steps = 0
    acc.sync_gradients = False
    assert acc.sync_gradients is False


def test_scheduler_ticks_once_per_process_per_optimizer_step_as_in_accelerate():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    from kiln.accumulation import GradientState

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: tick)
    prepared = PreparedScheduler(scheduler, [], GradientState(), ticks_per_step=3)
    prepared.step()
    assert scheduler.last_epoch == 3
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=4)
    prepared = PreparedScheduler(cycle, [], GradientState(), ticks_per_step=3)
    prepared.step()
    prepared.step()  # would pass total_steps: OneCycleLR raises there, so the extra ticks are dropped
    assert cycle.last_epoch == 4


def test_dataloader_configuration_fields():
    acc = Accelerator(dataloader_config=kiln.DataLoaderConfiguration(data_seed=1234, non_blocking=True))
    assert acc.data_seed == 1234
    with pytest.raises(NotImplementedError, match="dispatch_batches=True"):
        kiln.DataLoaderConfiguration(dispatch_batches=True)
    with pytest.warns(FutureWarning, match="DataLoaderConfiguration\\(split_batches=\\)"):
        acc = Accelerator(split_batches=True)
    assert acc.dataloader_config.split_batches
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4))
    assert [len(b[0]) for b in loader] == [4, 4]  # one process: the whole batch is its share


def test_deepspeed_config_changed_by_a_script_reaches_the_engine_config():
    from kiln.parallel.deepspeed import build_config

    plugin = kiln.DeepSpeedPlugin()
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 7  # what diffusers scripts do before prepare
    built = build_config(plugin, mixed_precision="no", gradient_accumulation_steps=1, micro_batch_size=None)
    assert built["train_micro_batch_size_per_gpu"] == 7 and "optimizer" not in plugin.deepspeed_config


def test_find_executable_batch_size_halves_on_out_of_memory():
    tried = []

    @kiln.find_executable_batch_size(starting_batch_size=64)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale

    assert train(2) == 32 and tried == [64, 32, 16]
    with pytest.raises(TypeError, match="without"):
        train(8, 2)

    @kiln.find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        broken()

    @kiln.find_executable_batch_size(starting_batch_size=2)
    def never(batch_size):
        raise torch.cuda.OutOfMemoryError("out of memory")

    with pytest.raises(RuntimeError, match="no executable batch size"):
        never()


def test_object_collectives_and_memory_helpers_on_one_process(monkeypatch):
    assert kiln.utils.gather_object({"a": 1}) == [{"a": 1}]
    values = [1, "x"]
    assert kiln.utils.broadcast_object_list(values) is values and values == [1, "x"]
    model, optimizer = kiln.utils.release_memory(torch.nn.Linear(2, 2), object())
    assert model is None and optimizer is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert kiln.utils.tqdm(range(3)).disable  # shown on each machine's first process only
    assert not kiln.utils.tqdm(range(3), main_process_only=False).disable


def test_profile_writes_profile_0_json_as_accelerate_names_it(tmp_path):
    folder = tmp_path / "traces" / "run"  # made if missing
    acc = Accelerator(kwargs_handlers=[kiln.ProfileKwargs(record_shapes=True, output_trace_dir=str(folder))])
    with acc.profile() as profiler:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert any("mm" in event.key for event in profiler.key_averages())
    assert sorted(path.name for path in folder.iterdir()) == ["profile_0.json"]
    trace = json.loads((folder / "profile_0.json").read_text())  # Chrome's trace format
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])


def test_profile_calls_on_trace_ready_at_each_scheduled_recording():
    ready = []
    handler = kiln.ProfileKwargs(schedule_option=dict(wait=0, warmup=0, active=1), on_trace_ready=ready.append)
    with Accelerator().profile(handler) as profiler:
        for _ in range(2):
            torch.randn(8, 8) @ torch.randn(8, 8)
            profiler.step()
    assert ready == [profiler] * 3  # after each of the 2 recorded steps, and for the one open at the end


def test_triggers_and_local_main_process_first_on_one_process():
    acc = Accelerator()
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False  # lowered after a check
    order = []
    with acc.local_main_process_first():
        order.append(acc.process_index)
    assert order == [0]


def test_save_state_with_safe_serialization_false_says_what_is_written(tmp_path):
    acc = Accelerator()
    acc.prepare(Regressor())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NotImplementedError, match="safetensors"):
            acc.save_state(tmp_path / "ckpt", safe_serialization=False)


def test_init_process_group_kwargs_reach_the_process_group(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    handler = kiln.InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=321))
    Accelerator(kwargs_handlers=[handler])
    (backend, kwargs), = calls
    assert backend == "gloo" and kwargs["timeout"] == datetime.timedelta(seconds=321)


def test_process_decorators_settings_and_refused_methods():
    acc = Accelerator(dataloader_config=kiln.DataLoaderConfiguration(even_batches=False))
    ran = []
    acc.on_local_main_process(lambda: ran.append("local main"))()
    acc.on_last_process(lambda: ran.append("last"))()
    acc.on_process(lambda: ran.append("process 0"), process_index=0)()
    acc.on_process(process_index=1)(lambda: ran.append("process 1"))()
    acc.on_local_process(lambda: ran.append("local 0"), local_process_index=0)()
    assert ran == ["local main", "last", "process 0", "local 0"]
    assert acc.even_batches is False and acc.split_batches is False and acc.should_save_model
    assert (acc.data_parallel_rank, acc.tensor_parallel_rank, acc.torch_device_mesh) == (0, 0, None)
    assert acc.clear() == [] and acc.verify_device_map(Regressor()) is False
    with pytest.raises(NotImplementedError, match="LOMO"):
        acc.lomo_backward(None, 0.1)


def test_logger_in_order_and_warning_once(caplog):
    from kiln.logging import get_logger

    logger = get_logger("kiln.test", log_level="INFO")
    with caplog.at_level("INFO", logger="kiln.test"):
        logger.info("each process", main_process_only=False, in_order=True)
        for _ in range(3):
            logger.warning_once("once")
    assert [r.getMessage() for r in caplog.records] == ["each process", "once"]


def test_availability_checks_answer_for_this_machine():
    import importlib.util

    for name in ("deepspeed", "transformers", "datasets", "tensorboard", "wandb", "mlflow", "schedulefree"):
        assert getattr(kiln.utils, f"is_{name}_available")() == (importlib.util.find_spec(name) is not None)
    assert kiln.utils.is_cuda_available() == torch.cuda.is_available()
    assert kiln.utils.is_npu_available() is False and isinstance(kiln.utils.is_xpu_available(), bool)
    assert isinstance(kiln.utils.is_mps_available(), bool) and isinstance(kiln.utils.is_bf16_available(), bool)
    acc = Accelerator()
    assert acc.multi_device is False and acc.is_fsdp2 is False and acc.deepspeed_plugin is None
    assert (acc.non_blocking, acc.use_seedable_sampler, acc.use_stateful_dataloader, acc.dispatch_batches) == \
        (False, False, False, None)
