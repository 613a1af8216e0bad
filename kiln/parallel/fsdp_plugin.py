"""FSDP2's settings as Accelerate spells them: `FullyShardedDataParallelPlugin` (from Python, or
from the `FSDP_*` variables `kiln launch` sets) and the choice of the modules sharded as units.

Depends on torch and kiln.plugins (parse_bool) only; the strategy (kiln.parallel.fsdp) reads it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

import torch
from torch import nn

from kiln.plugins import parse_bool

ENV_PREFIX = "FSDP_"
_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Accelerate's names for a whole policy: parameters gathered in, and gradients reduced in, one dtype
# (its "fp8" gathers bf16 weights for torchao's float8 matmuls).
_POLICY_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
# Accelerate's FSDP1 fields (and the variables its launcher sets for them), which FSDP2 has no knob for,
# and its activation_checkpointing_offload, which Kiln does not do.
_FSDP1_FIELDS = {
    "sharding_strategy": "reshard_after_forward=True/False (FULL_SHARD/SHARD_GRAD_OP)",
    "backward_prefetch": "nothing: FSDP2 prefetches the next block by itself",
    "forward_prefetch": "nothing: FSDP2 prefetches the next block by itself",
    "use_orig_params": "nothing: FSDP2 always trains the original parameters",
    "sync_module_states": "cpu_ram_efficient_loading=True (process 0's weights are broadcast)",
    "limit_all_gathers": "nothing: FSDP2 limits in-flight all-gathers by itself",
    "param_init_fn": "cpu_ram_efficient_loading=True (process 0's weights are broadcast)",
    "state_dict_config": "state_dict_type",
    "optim_state_dict_config": "state_dict_type",
    "activation_checkpointing_offload": "activation_checkpointing=True alone (Kiln does not offload the "
                                        "checkpointed inputs to the CPU)",
}
_FSDP1_VARIABLES = {"FSDP_SHARDING_STRATEGY": "sharding_strategy", "FSDP_BACKWARD_PREFETCH": "backward_prefetch",
                    "FSDP_FORWARD_PREFETCH": "forward_prefetch", "FSDP_USE_ORIG_PARAMS": "use_orig_params",
                    "FSDP_SYNC_MODULE_STATES": "sync_module_states",
                    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "activation_checkpointing_offload"}


@dataclass
class FullyShardedDataParallelPlugin:
    """FSDP2 settings, with Accelerate's field names and meanings; a field left None is read from
    its `FSDP_*` variable (what `kiln launch` sets), else takes the default below.

    fsdp_version: 2 (Kiln shards with FSDP2 only; 1 is refused, as are FSDP1's fields).
    reshard_after_forward (True): free each unit's gathered parameters after its forward (less
    memory, one more all-gather in backward; the arithmetic is the same).
    mixed_precision (Kiln's, None): None or "no" keeps the parameters fp32 and the Accelerator's
    `mixed_precision` autocasts around them, the plain loop's arithmetic; "bf16" or "fp16" has FSDP
    gather the parameters in that dtype (every op then runs on half weights), gradients still
    reduced in fp32. mixed_precision_policy (Accelerate's, None): "bf16", "fp16", "fp32" or "fp8"
    (bf16 weights) gathers parameters *and reduces gradients* in that dtype, as Accelerate does;
    or a dict of `MixedPrecisionPolicy` fields, or a `MixedPrecisionPolicy`. Give one of the two.
    auto_wrap_policy: which modules are sharded as units of their own, before the root. None:
    each repeated block (the compiled regions); "transformer_based_wrap": every module of the
    classes in `transformer_cls_names_to_wrap` (default: the model's `_no_split_modules`);
    "size_based_wrap": every module holding more than `min_num_params` parameters; "no_wrap":
    the root alone; or a callable `policy(module) -> bool`.
    state_dict_type: "SHARDED_STATE_DICT" (`save_state` writes each process's shards) or
    "FULL_STATE_DICT" (whole weights and optimizer files, gathered, written by the main process).
    cpu_ram_efficient_loading (False): process 0's weights are the model's; the other processes may
    hold any values (or meta tensors) and receive process 0's at `prepare`.
    activation_checkpointing (False): recompute each block's activations in backward (inside its
    compiled graph). ignored_modules: modules (or a regular expression over their names) FSDP
    leaves whole and unsynchronized. cpu_offload (False): keep the shards and their optimizer
    state on the CPU.
    """

    fsdp_version: int | None = None
    reshard_after_forward: bool | str | None = None
    mixed_precision: str | None = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: str | Callable[[nn.Module], bool] | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None
    state_dict_type: Any = None
    cpu_ram_efficient_loading: bool | None = None
    activation_checkpointing: bool | None = None
    ignored_modules: Iterable[nn.Module] | str | None = None
    cpu_offload: bool | None = None
    # Refused (FSDP1's, or not done by Kiln): arguments so that the error can say what to do instead.
    sharding_strategy: Any = None
    backward_prefetch: Any = None
    forward_prefetch: Any = None
    use_orig_params: Any = None
    sync_module_states: Any = None
    limit_all_gathers: Any = None
    param_init_fn: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    activation_checkpointing_offload: Any = None

    def __post_init__(self) -> None:
        env = os.environ
        self.fsdp_version = int(_from_env(self.fsdp_version, "VERSION", 2))
        if self.fsdp_version != 2:
            raise ValueError(f"fsdp_version={self.fsdp_version}: Kiln shards with FSDP2 (fully_shard) only; use "
                             "fsdp_version=2 (FSDP2's fields: reshard_after_forward, auto_wrap_policy, "
                             "state_dict_type, cpu_ram_efficient_loading, activation_checkpointing)")
        given = [(name, name) for name in _FSDP1_FIELDS if getattr(self, name) is not None]
        given += [(f"{var}={env[var]} (environment)", name) for var, name in _FSDP1_VARIABLES.items()
                  if _asks_for_something(env.get(var, "")) and getattr(self, name) is None]
        if given:
            instead = "; ".join(f"for {name}, {_FSDP1_FIELDS[name]}" for _, name in given)
            raise ValueError(f"{', '.join(label for label, _ in given)}: not an FSDP2 setting, and Kiln shards with "
                             f"FSDP2 (fsdp_version=2). Instead: {instead}")
        self.reshard_after_forward = _boolean(_from_env(self.reshard_after_forward, "RESHARD_AFTER_FORWARD", True),
                                              "reshard_after_forward", fsdp1_hint=True)
        self.activation_checkpointing = _boolean(
            _from_env(self.activation_checkpointing, "ACTIVATION_CHECKPOINTING", False), "activation_checkpointing")
        self.cpu_ram_efficient_loading = _boolean(
            _from_env(self.cpu_ram_efficient_loading, "CPU_RAM_EFFICIENT_LOADING", False), "cpu_ram_efficient_loading")
        self.cpu_offload = _boolean(_from_env(self.cpu_offload, "OFFLOAD_PARAMS", False), "cpu_offload")
        if self.mixed_precision is not None and self.mixed_precision not in _DTYPES:
            raise ValueError(f"unknown FSDP mixed_precision {self.mixed_precision!r}; choose one of: "
                             f"{', '.join(_DTYPES)}")
        if self.mixed_precision not in (None, "no") and self.mixed_precision_policy is not None:
            raise ValueError("give mixed_precision (Kiln's: parameter dtype only) or mixed_precision_policy "
                             "(Accelerate's: parameters and gradient reduction), not both")
        self._check_policy()
        self._check_wrap_policy()
        self.state_dict_type = _state_dict_type(_from_env(self.state_dict_type, "STATE_DICT_TYPE",
                                                          "SHARDED_STATE_DICT"))
        if self.ignored_modules is None:
            self.ignored_modules = env.get(ENV_PREFIX + "IGNORED_MODULES") or None
        if isinstance(self.ignored_modules, str):
            re.compile(self.ignored_modules)  # a bad expression fails here, not at prepare

    def _check_policy(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = self.mixed_precision_policy
        if policy is None or isinstance(policy, MixedPrecisionPolicy):
            return
        if isinstance(policy, str):
            if policy not in _POLICY_DTYPES:
                raise ValueError(f"mixed_precision_policy={policy!r}; choose one of: {', '.join(_POLICY_DTYPES)}, "
                                 "a dict of MixedPrecisionPolicy fields, or a MixedPrecisionPolicy")
            return
        if not isinstance(policy, dict):
            raise TypeError(f"mixed_precision_policy must be a str, a dict or a MixedPrecisionPolicy, "
                            f"not {type(policy).__name__}")
        known = {f.name for f in fields(MixedPrecisionPolicy)}
        unknown = sorted(set(policy) - known)
        if unknown:
            raise ValueError(f"mixed_precision_policy: unknown field(s) {', '.join(unknown)}; "
                             f"MixedPrecisionPolicy takes {', '.join(sorted(known))}")

    def mp_policy(self) -> Any:
        """The `MixedPrecisionPolicy` handed to `fully_shard`. Gradients are reduced in fp32 unless
        `mixed_precision_policy` says otherwise."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = self.mixed_precision_policy
        if isinstance(policy, MixedPrecisionPolicy):
            return policy
        if isinstance(policy, str):
            return MixedPrecisionPolicy(param_dtype=_POLICY_DTYPES[policy], reduce_dtype=_POLICY_DTYPES[policy])
        if isinstance(policy, dict):
            return MixedPrecisionPolicy(**{k: _dtype(v, k) if k.endswith("_dtype") else v for k, v in policy.items()})
        return MixedPrecisionPolicy(param_dtype=_DTYPES[self.mixed_precision or "no"], reduce_dtype=torch.float32)

    def _check_wrap_policy(self) -> None:
        policy = _from_env(self.auto_wrap_policy, "AUTO_WRAP_POLICY", None)
        if isinstance(policy, str):
            policy = policy.strip().lower()
            if policy not in WRAP_POLICIES:
                raise ValueError(f"auto_wrap_policy={self.auto_wrap_policy!r}; choose one of: "
                                 f"{', '.join(WRAP_POLICIES)}, a callable policy(module) -> bool, or None "
                                 "(each repeated block)")
        elif policy is not None and not callable(policy):
            raise TypeError(f"auto_wrap_policy must be a name or a callable, not {type(policy).__name__}")
        self.auto_wrap_policy = policy
        names = _from_env(self.transformer_cls_names_to_wrap, "TRANSFORMER_CLS_TO_WRAP", None)
        if isinstance(names, str):
            names = [name.strip() for name in names.split(",") if name.strip()]
        self.transformer_cls_names_to_wrap = list(names) if names is not None else None
        if self.transformer_cls_names_to_wrap is not None and policy != "transformer_based_wrap":
            raise ValueError("transformer_cls_names_to_wrap is read with auto_wrap_policy='transformer_based_wrap' "
                             f"only (auto_wrap_policy is {policy!r})")
        minimum = _from_env(self.min_num_params, "MIN_NUM_PARAMS", None)
        if minimum is not None:
            if isinstance(minimum, bool) or not str(minimum).strip().isdigit():
                raise ValueError(f"min_num_params must be a whole number, not {minimum!r}")
            minimum = int(minimum)
        self.min_num_params = minimum
        if policy == "size_based_wrap" and not minimum:
            raise ValueError("auto_wrap_policy='size_based_wrap' needs min_num_params > 0 (a module holding more "
                             "parameters than that is sharded as a unit of its own)")
        if minimum is not None and policy != "size_based_wrap":
            raise ValueError(f"min_num_params is read with auto_wrap_policy='size_based_wrap' only "
                             f"(auto_wrap_policy is {policy!r})")

    def offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """What the next `save_state` writes (Accelerate's method: scripts switch to FULL_STATE_DICT
        before a final save). None: the `FSDP_STATE_DICT_TYPE` variable, else SHARDED_STATE_DICT."""
        self.state_dict_type = _state_dict_type(_from_env(state_dict_type, "STATE_DICT_TYPE", "SHARDED_STATE_DICT"))

    @property
    def writes_whole_checkpoints(self) -> bool:
        return self.state_dict_type == "FULL_STATE_DICT"


def shard_units(model: nn.Module, plugin: FullyShardedDataParallelPlugin, block_paths: list[str]) -> list[str]:
    """The names of the modules sharded as units of their own (children before their parents; the
    root is sharded after them, always), as `plugin.auto_wrap_policy` chooses them."""
    policy = plugin.auto_wrap_policy
    if policy is None:
        return list(block_paths)
    if policy == "no_wrap":
        return []
    if policy == "transformer_based_wrap":
        classes = _classes_to_wrap(model, plugin.transformer_cls_names_to_wrap)
        chosen = lambda module: isinstance(module, classes)  # noqa: E731
    elif policy == "size_based_wrap":
        chosen = lambda module: sum(p.numel() for p in module.parameters()) > plugin.min_num_params  # noqa: E731
    else:
        chosen = policy
    named = [(name, module) for name, module in model.named_modules() if name]
    # Deepest first, as FSDP2 needs: a unit's parameters are those its sharded children do not hold.
    named.sort(key=lambda item: -item[0].count("."))
    return [name for name, module in named if chosen(module)]


def _classes_to_wrap(model: nn.Module, names: list[str] | None) -> tuple[type, ...]:
    present = {type(m).__name__: type(m) for m in model.modules()}
    if names is None:
        declared = list(getattr(model, "_no_split_modules", None) or [])
        names = [name for name in declared if name in present]
        if not names:
            declares = "only absent ones: " + ", ".join(declared) if declared else "no _no_split_modules"
            raise ValueError(f"auto_wrap_policy='transformer_based_wrap' has no class to wrap: {type(model).__name__} "
                             f"declares {declares}; name them with transformer_cls_names_to_wrap=[...]")
    missing = [name for name in names if name not in present]
    if missing:
        raise ValueError(f"transformer_cls_names_to_wrap names {', '.join(missing)}, which {type(model).__name__} "
                         f"does not hold; its module classes: {', '.join(sorted(present))}")
    return tuple(present[name] for name in names)


def ignored_parameters(model: nn.Module, ignored: Iterable[nn.Module] | str | None) -> set[nn.Parameter]:
    """The parameters of `ignored` (modules, or a regular expression matched against whole module names)."""
    if ignored is None:
        return set()
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
        if not modules:
            raise ValueError(f"ignored_modules={ignored!r} matches no module name of {type(model).__name__}")
    else:
        modules = list(ignored)
    return {p for module in modules for p in module.parameters()}


def _asks_for_something(raw: str) -> bool:
    """An FSDP1 variable set to a value that changes anything: a launcher that exports them all
    exports false and NO_PREFETCH for the ones it was not asked for."""
    return raw.strip().lower() not in ("", "0", "false", "no", "off", "no_prefetch")


def _from_env(value: Any, name: str, default: Any) -> Any:
    if value is not None:
        return value
    raw = os.environ.get(ENV_PREFIX + name)
    return raw if raw not in (None, "") else default


def _boolean(value: Any, name: str, fsdp1_hint: bool = False) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if fsdp1_hint and value.strip().upper() in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
            raise ValueError(f"{name}={value!r} is an FSDP1 sharding strategy; FSDP2 takes true (FULL_SHARD's "
                             "behaviour) or false (SHARD_GRAD_OP's)")
        return parse_bool(value, ENV_PREFIX + name.upper())
    raise TypeError(f"{name} must be True or False, not {value!r}")


def _state_dict_type(value: Any) -> str:
    text = getattr(value, "name", value)  # torch's StateDictType enum, or its name
    text = str(text).strip().upper()
    if text == "LOCAL_STATE_DICT":
        raise ValueError("state_dict_type=LOCAL_STATE_DICT is FSDP1's; FSDP2 writes SHARDED_STATE_DICT or "
                         "FULL_STATE_DICT")
    if text not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={value!r}; choose one of: {', '.join(STATE_DICT_TYPES)}")
    return text


def _dtype(value: Any, field: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    named = _POLICY_DTYPES.get(str(value)) or getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(named, torch.dtype):
        raise ValueError(f"mixed_precision_policy[{field!r}]={value!r} is not a dtype")
    return named
