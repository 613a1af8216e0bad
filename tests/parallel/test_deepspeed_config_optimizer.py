"""DeepSpeed's config optimizer and scheduler through DummyOptim / DummyScheduler, without processes:
the "auto" values filled from the dummies, the refusals that name the section and the object, and
what the strategy hands DeepSpeed and the user (the training itself: tests/distributed)."""

from types import SimpleNamespace

import pytest
import torch

from kiln import Accelerator, DeepSpeedPlugin
from kiln.parallel.deepspeed import build_config
from kiln.utils import DummyOptim, DummyScheduler

AUTO_SECTIONS = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


def config(user, optimizer, scheduler=None, ticks=1):
    return build_config(DeepSpeedPlugin(hf_ds_config=user), mixed_precision="no", gradient_accumulation_steps=1,
                        micro_batch_size=4, optimizer=optimizer, scheduler=scheduler, ticks_per_step=ticks)


def linear():
    return torch.nn.Linear(2, 2)


def test_auto_values_of_both_sections_are_filled_from_the_dummies():
    optimizer = DummyOptim(linear().parameters(), lr=3e-4, weight_decay=0.1)
    scheduler = DummyScheduler(optimizer, total_num_steps=10, warmup_num_steps=0)
    built = config(AUTO_SECTIONS, optimizer, scheduler, ticks=2)
    assert built["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}
    # Warm-up from 0 to the optimizer's rate over at least 1 step (DeepSpeed 0.19 refuses 0); the
    # 10 ticks of 2 processes are 5 engine steps.
    assert built["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 1,
                                            "total_num_steps": 5}
    assert config(AUTO_SECTIONS, optimizer, scheduler, ticks=1)["scheduler"]["params"]["total_num_steps"] == 10
    assert built["gradient_clipping"] == 0.0  # Kiln's plain-loop default stays (DeepSpeed's own is 1.0)
    assert AUTO_SECTIONS["optimizer"]["params"]["lr"] == "auto"  # the user's dict is left as it was


def test_deepspeed_reads_the_filled_sections():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    optimizer = DummyOptim(linear().parameters(), lr=3e-4, weight_decay=0.1)
    read = DeepSpeedConfig(config(AUTO_SECTIONS, optimizer, DummyScheduler(optimizer, 10, 2)))
    assert read.optimizer_name == "adamw" and read.optimizer_params["lr"] == 3e-4
    assert read.scheduler_name == "WarmupDecayLR" and read.scheduler_params["total_num_steps"] == 10


def test_the_configs_own_values_stay_and_one_the_user_contradicts_is_an_error():
    user = {"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}
    optimizer = DummyOptim(linear().parameters())  # lr and weight_decay left at their defaults
    built = config(user, optimizer, DummyScheduler(optimizer))
    # The warm-up ends at the rate the engine's optimizer starts from: the config's.
    assert built["optimizer"]["params"] == {"lr": 5e-4} and built["scheduler"]["params"]["warmup_max_lr"] == 5e-4
    chosen = DummyOptim(linear().parameters(), lr=1e-4, weight_decay=0.1)
    del user["scheduler"]
    with pytest.raises(ValueError, match=r"optimizer\.params\.lr=0\.0005, but DummyOptim\(lr=\) says 0\.0001"):
        config(user, chosen)
    # A value given to the dummy where the config has none is used (DeepSpeed's default would not be).
    user["optimizer"]["params"]["lr"] = 1e-4
    assert config(user, chosen)["optimizer"]["params"] == {"lr": 1e-4, "weight_decay": 0.1}


def test_an_optimizer_section_with_a_torch_optimizer_is_refused_naming_both():
    message = r"`optimizer` section \(type 'AdamW'\), and prepare\(\) got a SGD.*DummyOptim"
    with pytest.raises(ValueError, match=message):
        config(AUTO_SECTIONS, torch.optim.SGD(linear().parameters(), lr=0.1))


def test_a_dummy_optim_without_an_optimizer_section_is_refused_naming_both():
    with pytest.raises(ValueError, match="got a DummyOptim.*the config has no `optimizer` section"):
        config({}, DummyOptim(linear().parameters()))


@pytest.mark.parametrize("case, message", [
    ("torch scheduler, section", r"`scheduler` section \(type 'WarmupDecayLR'\), and prepare\(\) got a StepLR"),
    ("dummy, no section", "got a DummyScheduler.*no `scheduler` section"),
    ("callable and section", "lr_scheduler_callable, and the DeepSpeed config has a `scheduler` section"),
    ("torch scheduler over the dummy", "got a LambdaLR over a DummyOptim"),
    ("dummy of another optimizer", "not the optimizer prepared with the model"),
])
def test_scheduler_mismatches_are_refused_naming_the_section_and_the_object(case, message):
    optimizer = DummyOptim(linear().parameters())
    sections = dict(AUTO_SECTIONS)
    if case == "torch scheduler, section":
        optimizer = torch.optim.SGD(linear().parameters(), lr=0.1)
        sections = {"scheduler": AUTO_SECTIONS["scheduler"]}
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    elif case == "dummy, no section":
        sections = {"optimizer": AUTO_SECTIONS["optimizer"]}
        scheduler = DummyScheduler(optimizer)
    elif case == "callable and section":
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: None)
    elif case == "torch scheduler over the dummy":
        sections = {"optimizer": AUTO_SECTIONS["optimizer"]}
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    else:
        scheduler = DummyScheduler(DummyOptim(linear().parameters()))
    with pytest.raises(ValueError, match=message):
        config(sections, optimizer, scheduler)


def test_dummy_optim_hands_deepspeed_the_users_groups_as_given():
    model = linear()
    groups = [{"params": iter([model.weight]), "weight_decay": 0.0}, {"params": [model.bias]}]
    optimizer = DummyOptim(groups, lr=0.1)
    # No lr or weight_decay written into the groups: those would override the config's in DeepSpeed.
    assert optimizer.params == [{"params": [model.weight], "weight_decay": 0.0}, {"params": [model.bias]}]
    assert [len(group["params"]) for group in optimizer.param_groups] == [1, 1]  # prepare() finds its model
    with pytest.raises(RuntimeError, match="not replaced by a DeepSpeed engine's optimizer"):
        optimizer.step()


def test_on_one_process_the_dummies_are_refused_at_prepare():
    with pytest.warns(UserWarning, match="single process"):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=AUTO_SECTIONS))
    model = linear()
    optimizer = DummyOptim(model.parameters())
    with pytest.raises(ValueError, match=r"got a DummyOptim.*runs no DeepSpeed engine \(strategy 'single', 1 "
                                         r"process\(es\)\).*two or more processes"):
        accelerator.prepare(model, optimizer)
    with pytest.raises(ValueError, match="got a DummyScheduler.*runs no DeepSpeed engine"):
        accelerator.prepare_scheduler(DummyScheduler(optimizer))


def fake_deepspeed(calls):
    """What deepspeed.initialize received, and an engine that built an optimizer and a scheduler."""
    built = torch.optim.SGD(linear().parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(built, step_size=1, gamma=0.5)
    engine = SimpleNamespace(basic_optimizer=built, optimizer=built, lr_scheduler=scheduler, module=None)

    def initialize(**kwargs):
        calls.append(kwargs)
        return engine, built, None, scheduler

    return SimpleNamespace(initialize=initialize)


@pytest.mark.parametrize("with_callable", [False, True])
def test_the_engine_builds_the_dummies_and_hands_back_its_own(monkeypatch, with_callable):
    pytest.importorskip("deepspeed")
    from kiln.accumulation import GradientState
    from kiln.parallel.deepspeed import DeepSpeedStrategy, EngineOptimizer

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    strategy = DeepSpeedStrategy(DeepSpeedPlugin(hf_ds_config=AUTO_SECTIONS if not with_callable else
                                                 {"optimizer": AUTO_SECTIONS["optimizer"]}), "no", 1)
    calls = []
    strategy.deepspeed = fake_deepspeed(calls)
    model = linear()
    optimizer = DummyOptim(model.parameters(), lr=0.05)
    make = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)) if with_callable else None
    scheduler = DummyScheduler(optimizer, total_num_steps=8, lr_scheduler_callable=make)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=4)
    strategy.begin_prepare((model, optimizer, loader, scheduler))
    engine = strategy.wrap_model(model, [])
    (kwargs,) = calls
    # No optimizer= or lr_scheduler= objects: the engine builds both, over the user's parameters.
    assert "optimizer" not in kwargs and kwargs["model_parameters"] is optimizer.params
    assert kwargs.get("lr_scheduler") is make
    assert kwargs["config"]["optimizer"]["params"]["lr"] == 0.05
    if not with_callable:
        assert kwargs["config"]["scheduler"]["params"]["total_num_steps"] == 4  # 8 ticks, 2 processes
    state = GradientState()
    prepared = strategy.wrap_optimizer(optimizer, state, None, None)
    assert isinstance(prepared, EngineOptimizer) and prepared.optimizer is engine.basic_optimizer
    prepared_scheduler = strategy.wrap_config_scheduler(scheduler, [prepared], state)
    assert prepared_scheduler.scheduler is engine.lr_scheduler and prepared_scheduler.get_last_lr() == [0.1]
    prepared_scheduler.step()  # the engine steps its scheduler inside backward: nothing here
    assert prepared_scheduler.get_last_lr() == [0.1]
    assert prepared_scheduler.state_dict() == engine.lr_scheduler.state_dict()


def test_a_dummy_scheduler_may_schedule_a_torch_optimizer_from_the_scheduler_section():
    # Accelerate refuses this pair; DeepSpeed builds the section's scheduler over the user's optimizer.
    optimizer = torch.optim.SGD(linear().parameters(), lr=0.1)
    built = config({"scheduler": AUTO_SECTIONS["scheduler"]}, optimizer, DummyScheduler(optimizer, 6, 2), ticks=2)
    assert built["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 2,
                                            "total_num_steps": 3}
    assert "optimizer" not in built
