"""Launch settings: one table of what `kiln config` writes and `kiln launch` reads, with the
environment variable each setting becomes in every process.

Depends on the standard library and PyYAML only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DEFAULT_CONFIG = Path(os.environ.get("KILN_CONFIG_FILE", "~/.cache/kiln/default_config.yaml")).expanduser()
DISTRIBUTED_TYPES = ("no", "ddp", "fsdp", "deepspeed")
PRECISIONS = ("no", "fp16", "bf16", "fp8")  # fp8: torchao's float8 training (kiln/fp8.py)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean; use true or false")


def _tristate(value: Any) -> bool | None:
    return None if value is None or str(value).strip().lower() in ("none", "auto", "") else _bool(value)


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"{value!r} is not one of: {', '.join(choices)}")
        return text
    return check


def _positive(value: Any) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(f"{value!r} must be at least 1")
    return number


def _zero_stage(value: Any) -> int:
    number = int(value)
    if number not in (0, 1, 2, 3):
        raise ValueError(f"{value!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    return number


def _norm(value: Any) -> float:
    number = float(value)
    if not number >= 0:
        raise ValueError(f"{value!r} must be a norm >= 0")
    return number


def _json_file(value: Any) -> str:
    path = Path(str(value)).expanduser().resolve()  # absolute: every process, wherever it runs from
    if not path.is_file():
        raise ValueError(f"no DeepSpeed config file at {path}")
    return str(path)


def _fsdp_version(value: Any) -> int:
    if str(value).strip() != "2":
        raise ValueError(f"{value!r}: Kiln shards with FSDP2 only; use 2")
    return 2


def _class_names(value: Any) -> str:
    """Accelerate writes one class name or several joined by commas; a YAML list is taken as well."""
    names = value if isinstance(value, (list, tuple)) else str(value).split(",")
    names = [str(name).strip() for name in names if str(name).strip()]
    if not names:
        raise ValueError(f"{value!r} names no class")
    return ",".join(names)


def _state_dict_type(value: Any) -> str:
    text = str(value).strip().upper()
    if text not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        raise ValueError(f"{value!r} is not one of: SHARDED_STATE_DICT, FULL_STATE_DICT")
    return text


def _non_negative(value: Any) -> int:
    number = int(value)
    if number < 0:
        raise ValueError(f"{value!r} must be 0 or more")
    return number


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    parse: Callable[[Any], Any]
    env: str | None  # the variable every launched process gets, if any
    help: str
    only_for: str | None = None  # a distributed_type this setting belongs to
    asked: bool = True  # False: `kiln config` does not ask for it (a flag or the file still sets it)


SETTINGS = (
    Setting("num_processes", 1, _positive, None, "processes in all, over every machine"),
    Setting("num_machines", 1, _positive, None, "machines taking part"),
    Setting("machine_rank", 0, _non_negative, None, "this machine's index, 0 for the main one"),
    Setting("main_process_ip", "127.0.0.1", str, None, "address of machine 0 (rendezvous)"),
    Setting("main_process_port", 29500, _positive, None, "port on machine 0 (rendezvous)"),
    Setting("distributed_type", "ddp", _choice(DISTRIBUTED_TYPES), "KILN_DISTRIBUTED_TYPE",
            "how processes share the model"),
    Setting("mixed_precision", "no", _choice(PRECISIONS), "KILN_MIXED_PRECISION", "autocast dtype"),
    Setting("use_cpu", False, _bool, "KILN_USE_CPU", "train on the CPU even with a GPU"),
    Setting("dynamo_backend", "no", str, "KILN_DYNAMO_BACKEND", "torch.compile backend; 'no' for none"),
    Setting("dynamo_mode", None, lambda v: None if v in (None, "") else str(v), "KILN_DYNAMO_MODE",
            "Inductor mode"),
    Setting("dynamo_use_fullgraph", False, _bool, "KILN_DYNAMO_USE_FULLGRAPH", "fullgraph=True"),
    Setting("dynamo_use_dynamic", None, _tristate, "KILN_DYNAMO_USE_DYNAMIC", "dynamic shapes: true/false/none"),
    Setting("dynamo_use_regional_compilation", False, _bool, "KILN_DYNAMO_USE_REGIONAL_COMPILATION",
            "compile each repeated block once"),
    Setting("deepspeed_config_file", None, _json_file, "KILN_DEEPSPEED_CONFIG_FILE",
            "DeepSpeed config JSON (\"auto\" values are filled by Kiln)", "deepspeed"),
    Setting("zero_stage", None, _zero_stage, "KILN_DEEPSPEED_ZERO_STAGE", "ZeRO stage 0-3 (default 2)", "deepspeed"),
    Setting("gradient_clipping", None, _norm, "KILN_DEEPSPEED_GRADIENT_CLIPPING",
            "max gradient norm DeepSpeed clips to in its step", "deepspeed"),
    Setting("offload_optimizer_device", None, _choice(("none", "cpu")), "KILN_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            "where ZeRO keeps optimizer state: none or cpu", "deepspeed"),
    Setting("offload_param_device", None, _choice(("none", "cpu")), "KILN_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
            "where ZeRO-3 keeps parameters: none or cpu", "deepspeed"),
    # FSDP2, under Accelerate's names (kiln.parallel.fsdp_plugin reads the FSDP_* variables).
    Setting("fsdp_version", None, _fsdp_version, "FSDP_VERSION", "FSDP version: 2 (the only one)", "fsdp",
            asked=False),
    Setting("fsdp_auto_wrap_policy", None, _choice(("transformer_based_wrap", "size_based_wrap", "no_wrap")),
            "FSDP_AUTO_WRAP_POLICY", "units sharded on their own (default: each repeated block)", "fsdp", asked=False),
    Setting("fsdp_transformer_layer_cls_to_wrap", None, _class_names, "FSDP_TRANSFORMER_CLS_TO_WRAP",
            "block classes transformer_based_wrap shards, comma-separated", "fsdp", asked=False),
    Setting("fsdp_min_num_params", None, _positive, "FSDP_MIN_NUM_PARAMS",
            "size_based_wrap shards modules holding more parameters than this", "fsdp", asked=False),
    Setting("fsdp_state_dict_type", None, _state_dict_type, "FSDP_STATE_DICT_TYPE",
            "what save_state writes: SHARDED_STATE_DICT or FULL_STATE_DICT", "fsdp", asked=False),
    Setting("fsdp_reshard_after_forward", None, _bool, "FSDP_RESHARD_AFTER_FORWARD",
            "free gathered parameters after each unit's forward", "fsdp", asked=False),
    Setting("fsdp_activation_checkpointing", None, _bool, "FSDP_ACTIVATION_CHECKPOINTING",
            "recompute each block's activations in backward", "fsdp", asked=False),
    Setting("fsdp_cpu_ram_efficient_loading", None, _bool, "FSDP_CPU_RAM_EFFICIENT_LOADING",
            "process 0's weights are broadcast to the others at prepare", "fsdp", asked=False),
    Setting("fsdp_offload_params", None, _bool, "FSDP_OFFLOAD_PARAMS", "keep shards on the CPU", "fsdp", asked=False),
    # Accelerate's ParallelismConfig sizes (kiln.parallel.parallelism_config reads PARALLELISM_CONFIG_*).
    *(Setting(f"parallelism_config_{dim}_size", None, _positive, f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", help,
              asked=False)
      for dim, help in (("dp_replicate", "copies of the model (HSDP's replicas)"),
                        ("dp_shard", "processes each copy is sharded over (FSDP2)"),
                        ("tp", "tensor parallel size (Kiln: 1 only, for now)"),
                        ("cp", "context parallel size (Kiln: 1 only, for now)"))),
    Setting("process_group_timeout", 600, _positive, "KILN_PROCESS_GROUP_TIMEOUT",
            "seconds a collective waits for a lost process"),
    Setting("max_restarts", 0, _non_negative, None,
            "times the launcher restarts every process of this machine after one fails; the script "
            "resumes from its latest checkpoint (torchrun's elastic restarts)"),
)
BY_NAME = {s.name: s for s in SETTINGS}


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The settings of a YAML file; unknown keys and bad values are errors that name them."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no config file at {file}; write one with `kiln config`")
    raw = yaml.safe_load(file.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a mapping of settings, not {type(raw).__name__}")
    raw = _flatten_nested(_flatten_nested(raw, file, "fsdp_config"), file, "parallelism_config")
    refused = sorted(set(raw) & set(FSDP1_SETTINGS))
    if refused:
        raise ValueError(f"{file}: {', '.join(refused)}: FSDP1 setting(s); Kiln shards with FSDP2, which has no such "
                         f"setting ({'; '.join(f'{name}: {FSDP1_SETTINGS[name]}' for name in refused)})")
    unknown = sorted(set(raw) - set(BY_NAME))
    if unknown:
        raise ValueError(f"{file}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    return {name: _parse(name, value, str(file)) for name, value in raw.items()}


# Accelerate's FSDP1 keys, and what FSDP2 does instead.
FSDP1_SETTINGS = {
    "fsdp_sharding_strategy": "use fsdp_reshard_after_forward (true for FULL_SHARD, false for SHARD_GRAD_OP)",
    "fsdp_backward_prefetch": "FSDP2 prefetches by itself", "fsdp_forward_prefetch": "FSDP2 prefetches by itself",
    "fsdp_use_orig_params": "FSDP2 always trains the original parameters",
    "fsdp_sync_module_states": "use fsdp_cpu_ram_efficient_loading",
}


def _flatten_nested(raw: dict[str, Any], file: Path, key: str) -> dict[str, Any]:
    """Accelerate's files nest the FSDP and parallelism keys under `fsdp_config:` and
    `parallelism_config:`; they are the same settings here."""
    nested = raw.get(key)
    rest = {k: v for k, v in raw.items() if k != key}
    if nested is None:
        return rest
    if not isinstance(nested, dict):
        raise ValueError(f"{file}: {key} must be a mapping of settings")
    clash = sorted(set(nested) & set(rest))
    if clash:
        raise ValueError(f"{file}: {', '.join(clash)} given both inside {key} and at the top level")
    return {**rest, **nested}


def _parse(name: str, value: Any, source: str) -> Any:
    try:
        return BY_NAME[name].parse(value) if value is not None else None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {name}: {error}") from None


def resolve(flags: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Flags win over the config file, which wins over the defaults. `settings["explicit"]` names
    the settings that came from a flag or the file."""
    settings: dict[str, Any] = {"explicit": {n for n in BY_NAME if flags.get(n) is not None or n in config}}
    for setting in SETTINGS:
        if flags.get(setting.name) is not None:
            settings[setting.name] = _parse(setting.name, flags[setting.name], "--" + setting.name)
        elif setting.name in config:
            settings[setting.name] = config[setting.name]
        else:
            settings[setting.name] = setting.default
    if settings["num_processes"] % settings["num_machines"]:
        raise ValueError(f"num_processes={settings['num_processes']} does not split evenly over "
                         f"num_machines={settings['num_machines']}")
    for setting in SETTINGS:
        if setting.only_for and settings[setting.name] is not None and settings["distributed_type"] != setting.only_for:
            raise ValueError(f"{setting.name} is a {setting.only_for} setting, but distributed_type is "
                             f"{settings['distributed_type']}")
    if settings["max_restarts"] and settings["num_machines"] > 1:
        # Each machine's launcher counts its own restarts; the restarted processes find one another
        # through a store prefix of that count (kiln.state), which would then differ between machines.
        raise ValueError("max_restarts works on one machine: each machine's launcher would restart its own "
                         "processes on its own count; for several machines, rerun the launch (the script "
                         "resumes from its latest checkpoint) or use torchrun's elastic rendezvous yourself")
    if settings["machine_rank"] >= settings["num_machines"]:
        raise ValueError(f"machine_rank={settings['machine_rank']} but num_machines={settings['num_machines']}")
    return settings


def process_environment(settings: dict[str, Any]) -> dict[str, str]:
    """The variables every launched process gets, so every setting given reaches every process.

    Settings left at their defaults are not exported: the script's own arguments and the shell's
    environment then decide, as they would without the launcher."""
    env = {}
    for setting in SETTINGS:
        value = settings[setting.name]
        if setting.env is None or value is None or setting.name not in settings["explicit"]:
            continue
        env[setting.env] = str(value).lower() if isinstance(value, bool) else str(value)
    if any(name.startswith("PARALLELISM_CONFIG_") for name in env):
        env["KILN_USE_PARALLELISM_CONFIG"] = "true"
    if settings["dynamo_backend"] in ("no", "none"):
        for name in ("KILN_DYNAMO_MODE", "KILN_DYNAMO_USE_FULLGRAPH", "KILN_DYNAMO_USE_DYNAMIC",
                     "KILN_DYNAMO_USE_REGIONAL_COMPILATION"):
            env.pop(name, None)
    return env


def add_setting_flags(parser: Any) -> None:
    for setting in SETTINGS:
        parser.add_argument(f"--{setting.name}", default=None, help=f"{setting.help} (default: {setting.default})")
