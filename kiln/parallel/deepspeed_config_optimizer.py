"""DeepSpeed's own optimizer and scheduler, built by its engine from the config's `optimizer` and
`scheduler` sections: `DummyOptim` and `DummyScheduler` stand for them in `prepare`, as in Accelerate.

Depends on torch only (DeepSpeed builds the real objects in kiln.parallel.deepspeed); nothing here
imports the facade or DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

# DummyOptim's defaults: a value the user left at its default does not contradict the config.
_DEFAULT_LR = 0.001
_DEFAULT_WEIGHT_DECAY = 0
_NO_ENGINE = ("Kiln runs a DeepSpeed engine with a DeepSpeedPlugin on two or more processes (on one process "
              "it trains without DeepSpeed)")


class DummyOptim(torch.optim.Optimizer):
    """Stands for the optimizer the DeepSpeed engine builds from its config's `optimizer` section;
    "auto" values there are filled from `lr` and `weight_decay`. The engine receives `params` (tensors
    or param groups, as given) and the prepared optimizer handed back is the one the engine built.

    >>> config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
    ...                                                      "torch_adam": True}}}
    >>> accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    >>> model, optimizer, loader = accelerator.prepare(model, DummyOptim(model.parameters(), lr=3e-4), loader)
    """

    def __init__(self, params: Iterable[Any], lr: float = _DEFAULT_LR, weight_decay: float = _DEFAULT_WEIGHT_DECAY,
                 **kwargs: Any) -> None:
        # The user's groups as given, for the engine: torch's Optimizer writes its defaults (lr,
        # weight_decay) into every group, which would override the config's values in DeepSpeed.
        self.params = [_own_group(item) for item in params]
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs
        # An Optimizer, so that prepare() takes it where it takes optimizers and finds its model.
        super().__init__([_own_group(item) for item in self.params], {"lr": lr, "weight_decay": weight_decay})

    def step(self, closure: Any = None) -> None:
        raise RuntimeError("this DummyOptim was not replaced by a DeepSpeed engine's optimizer: step the "
                           "optimizer that accelerator.prepare() returned, with a DeepSpeedPlugin whose config has "
                           f"an `optimizer` section. {_NO_ENGINE}")


def _own_group(item: Any) -> Any:
    """A param group as a new dict with its own list of tensors (generators are read once)."""
    return {**item, "params": list(item["params"])} if isinstance(item, dict) else item


class DummyScheduler:
    """Stands for the LR scheduler the DeepSpeed engine builds from its config's `scheduler` section
    and steps itself; "auto" values there are filled from these arguments (`total_num_steps` counts
    scheduler ticks, one per process per optimizer step as Kiln's prepared schedulers tick, unless
    batches are split). With `lr_scheduler_callable` and no `scheduler` section, the engine calls it
    with its optimizer to make the scheduler.

    >>> scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    """

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Callable[[torch.optim.Optimizer], Any] | None = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this DummyScheduler was not replaced by a DeepSpeed engine's scheduler: step the "
                           "scheduler that accelerator.prepare() returned, with a DeepSpeedPlugin whose config has "
                           f"a `scheduler` section. {_NO_ENGINE}")

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("a DummyScheduler has no state: save the scheduler that accelerator.prepare() returned")


def refuse_without_engine(objects: Iterable[Any], strategy_name: str, num_processes: int) -> None:
    """A ValueError when prepare() gets a dummy and this Accelerator will build no DeepSpeed engine."""
    if strategy_name == "deepspeed":
        return
    for obj in objects:
        if isinstance(obj, (DummyOptim, DummyScheduler)):
            section = "optimizer" if isinstance(obj, DummyOptim) else "scheduler"
            raise ValueError(
                f"prepare() got a {type(obj).__name__}, which stands for the {section} a DeepSpeed engine builds "
                f"from its config's `{section}` section, but this Accelerator runs no DeepSpeed engine (strategy "
                f"{strategy_name!r}, {num_processes} process(es)). {_NO_ENGINE}: launch two or more processes with "
                f"a DeepSpeedPlugin, or create the {section} yourself (e.g. torch.optim.AdamW(model.parameters(), "
                "lr=...) and a torch LR scheduler)")


def check_config_sections(config: dict, optimizer: Any, scheduler: Any) -> None:
    """The config's `optimizer`/`scheduler` sections and the objects of the prepare() call must agree:
    a section is built by the engine and needs its dummy; a dummy needs its section. `optimizer` is
    the model's optimizer in the call (None: none), `scheduler` its scheduler (None: none)."""
    has_optimizer, has_scheduler = "optimizer" in config, "scheduler" in config
    if has_optimizer and not isinstance(optimizer, DummyOptim):
        raise ValueError(f"the DeepSpeed config has an `optimizer` section ({_kind(config['optimizer'])}), and "
                         f"prepare() got {_describe(optimizer)} for the model: the engine would build its own "
                         "optimizer from the section. Pass kiln.utils.DummyOptim(model.parameters(), lr=...) to train "
                         "with the config's optimizer, or remove the `optimizer` section to train with yours")
    if isinstance(optimizer, DummyOptim) and not has_optimizer:
        raise ValueError("prepare() got a DummyOptim, which stands for the optimizer of the DeepSpeed config's "
                         "`optimizer` section, and the config has no `optimizer` section: add one (e.g. "
                         '{"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}) or pass a torch '
                         "optimizer")
    if has_scheduler and scheduler is not None and not isinstance(scheduler, DummyScheduler):
        raise ValueError(f"the DeepSpeed config has a `scheduler` section ({_kind(config['scheduler'])}), and "
                         f"prepare() got {_describe(scheduler)}: the engine steps the section's scheduler, so both "
                         "would change the learning rate. Pass kiln.utils.DummyScheduler(optimizer, ...) for the "
                         "config's scheduler, or remove the `scheduler` section to use yours")
    if isinstance(optimizer, DummyOptim) and scheduler is not None and not isinstance(scheduler, DummyScheduler):
        raise ValueError(f"prepare() got {_describe(scheduler)} over a DummyOptim: it would set the rates of the "
                         "stand-in, not of the optimizer the engine builds. Pass kiln.utils.DummyScheduler(optimizer, "
                         "...) with a `scheduler` section, or DummyScheduler(optimizer, lr_scheduler_callable=...)")
    if not isinstance(scheduler, DummyScheduler):
        return
    if scheduler.lr_scheduler_callable is not None and has_scheduler:
        raise ValueError("prepare() got a DummyScheduler with lr_scheduler_callable, and the DeepSpeed config has a "
                         f"`scheduler` section ({_kind(config['scheduler'])}): the engine would use the callable and "
                         "ignore the section. Remove one of them")
    if scheduler.lr_scheduler_callable is None and not has_scheduler:
        raise ValueError("prepare() got a DummyScheduler, which stands for the scheduler of the DeepSpeed config's "
                         "`scheduler` section, and the config has no `scheduler` section: add one (e.g. "
                         '{"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": '
                         '"auto"}}), pass DummyScheduler(lr_scheduler_callable=...), or pass a torch LR scheduler')
    if scheduler.optimizer is not optimizer:
        raise ValueError("the DummyScheduler's optimizer is not the optimizer prepared with the model in this "
                         "prepare() call: create it as DummyScheduler(optimizer) from that DummyOptim")


def fill_config_sections(config: dict, optimizer: Any, scheduler: Any, ticks_per_step: int) -> None:
    """Fill the sections' "auto" values from the dummies, as Accelerate does: the optimizer's lr and
    weight_decay; the scheduler's warmup_min_lr (0), warmup_max_lr (the optimizer's lr),
    warmup_num_steps (at least 1: DeepSpeed 0.19 refuses 0) and total_num_steps (the dummy's ticks
    over `ticks_per_step`, the engine stepping once per optimizer step). Values the config sets
    stay; one that contradicts a value the user gave the dummy is an error, and a value the user
    gave DummyOptim where the config has none is used (Accelerate leaves DeepSpeed's default)."""
    if isinstance(optimizer, DummyOptim):
        params = config["optimizer"].setdefault("params", {})
        _fill_from_dummy(params, "optimizer.params", "lr", optimizer.lr, _DEFAULT_LR, "DummyOptim(lr=)")
        _fill_from_dummy(params, "optimizer.params", "weight_decay", optimizer.weight_decay, _DEFAULT_WEIGHT_DECAY,
                         "DummyOptim(weight_decay=)")
    if not isinstance(scheduler, DummyScheduler) or "scheduler" not in config:
        return
    params = config["scheduler"].setdefault("params", {})
    fills = {"warmup_min_lr": 0, "warmup_max_lr": _optimizer_lr(config, scheduler.optimizer),
             "warmup_num_steps": max(1, scheduler.warmup_num_steps)}
    if scheduler.total_num_steps is not None:
        fills["total_num_steps"] = math.ceil(scheduler.total_num_steps / ticks_per_step)
    for key, value in fills.items():
        if params.get(key) == "auto" and value is not None:
            params[key] = value


def _fill_from_dummy(params: dict, where: str, key: str, value: Any, default: Any, source: str) -> None:
    current = params.get(key)
    if current == "auto" or (current is None and value != default):  # left out: DeepSpeed's default
        params[key] = value
    elif current is not None and value != default and current != value:
        raise ValueError(f"the DeepSpeed config sets {where}.{key}={current!r}, but {source} says {value!r}; make "
                         f"them agree or set the config's value to \"auto\"")


def _optimizer_lr(config: dict, optimizer: Any) -> Any:
    """The learning rate the engine's optimizer will start from: the config's, else the dummy's or
    the torch optimizer's."""
    configured = config.get("optimizer", {}).get("params", {}).get("lr")
    if isinstance(configured, (int, float)) and not isinstance(configured, bool):
        return configured
    if isinstance(optimizer, DummyOptim):
        return optimizer.lr
    return getattr(optimizer, "defaults", {}).get("lr")


def _kind(section: Any) -> str:
    return f"type {section.get('type')!r}" if isinstance(section, dict) else repr(section)


def _describe(obj: Any) -> str:
    return "no optimizer" if obj is None else f"a {type(obj).__name__}"
