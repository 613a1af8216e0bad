"""Tensor parallelism: each block's projections split over the `tp` dimension of the device mesh
(attention and MLP inputs column-wise, their outputs row-wise), with torch's `parallelize_module`.

Depends on torch, and on torchao for the splits of its float8 layers. The plan is the one the
model declares (transformers' `base_model_tp_plan`), else Kiln's for the common decoder names; a
model transformers already parallelized (`tp_plan="auto"`) is taken as it is. Applied before activation checkpointing, compile and FSDP2
(torchtitan's order), so each compiled block holds the sharded matmuls and their collectives.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

# Kiln's plan where the model declares none: Llama, Mistral, Qwen, Gemma and their kin name them so.
DEFAULT_PLAN = {"*.self_attn.q_proj": "colwise", "*.self_attn.k_proj": "colwise", "*.self_attn.v_proj": "colwise",
                "*.self_attn.o_proj": "rowwise", "*.mlp.gate_proj": "colwise", "*.mlp.up_proj": "colwise",
                "*.mlp.down_proj": "rowwise"}
_STYLES = ("colwise", "rowwise")


def is_tensor_parallel(model: nn.Module) -> bool:
    """True when some parameter is already a DTensor (transformers' `tp_plan="auto"` made it so)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def tensor_parallel_plan(model: nn.Module, block_paths: list[str], plan: dict[str, str] | None = None) -> dict[str, str]:
    """Module name -> "colwise"/"rowwise" for the linears of the blocks at `block_paths`: from
    `plan` (patterns with `*`, as transformers writes them), else the model's own
    `config.base_model_tp_plan`, else `DEFAULT_PLAN`."""
    declared = plan if plan is not None else getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    patterns = dict(declared or DEFAULT_PLAN)
    unknown = sorted({style for style in patterns.values() if style not in _STYLES})
    if unknown:
        raise NotImplementedError(f"tensor-parallel plan styles {', '.join(unknown)} are not supported by Kiln "
                                  f"(it splits linears {' and '.join(_STYLES)}); give a plan of those two")
    compiled = [(re.compile(r"(?:^|.*\.)" + re.escape(p).replace(r"\*", r"\d+") + "$"), style)
                for p, style in patterns.items()]
    inside = tuple(path + "." for path in block_paths)
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        for pattern, style in compiled:
            if pattern.match(name) and name.startswith(inside):
                if not isinstance(module, nn.Linear):
                    raise NotImplementedError(f"the tensor-parallel plan splits {name} ({type(module).__name__}); "
                                              "Kiln splits nn.Linear layers only")
                chosen[name] = style
    if not chosen:
        raise ValueError(f"no layer of {type(model).__name__}'s blocks matches its tensor-parallel plan "
                         f"({', '.join(patterns)}); give a plan naming its projections")
    return chosen


def check_divisible(model: nn.Module, plan: dict[str, str], tp_size: int) -> None:
    """Every split dimension, and the attention heads, must divide by the tp size."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(f"{field}={heads} does not divide by tp_size={tp_size}: each process must hold whole "
                             "attention heads")
    for name, style in plan.items():
        linear = model.get_submodule(name)
        size = linear.out_features if style == "colwise" else linear.in_features
        if size % tp_size:
            raise ValueError(f"{name} splits {style} a dimension of {size}, which does not divide by tp_size={tp_size}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, block_paths: list[str],
                          plan: dict[str, str] | None = None) -> dict[str, str]:
    """Split the blocks' linears over `tp_mesh`, in place; returns the plan applied ({} when
    transformers had already split the model over a mesh of the same size)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    if is_tensor_parallel(model):
        sizes = {p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)}
        if sizes != {tp_mesh.size()}:
            raise ValueError(f"the model is already tensor-parallel over {sorted(sizes)} process(es), but "
                             f"ParallelismConfig's tp_size is {tp_mesh.size()}: load it with "
                             "device_mesh=accelerator.torch_device_mesh['tp']")
        return {}
    chosen = tensor_parallel_plan(model, block_paths, plan)
    check_divisible(model, chosen, tp_mesh.size())
    parallelize_module(model, tp_mesh, {name: parallel_style(model.get_submodule(name), style)
                                        for name, style in chosen.items()})
    return chosen


def parallel_style(linear: nn.Module, style: str) -> Any:
    """torch's split ("colwise" or "rowwise") for a plain linear; for torchao's Float8Linear (under
    mixed_precision="fp8"), torchao's float8-aware split, which casts the input to float8 as a DTensor
    (its scale taken over the whole tensor, as one process takes it) and the output's gradient on its
    way back. Under autocast the row-wise outputs are summed across the group in bf16, so tensor
    parallel differs from one process by bf16's rounding, with or without fp8."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if type(linear).__name__ != "Float8Linear":
        return (ColwiseParallel if style == "colwise" else RowwiseParallel)()
    from torchao.float8.config import ScalingType
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    scaling = (linear.config.cast_config_input.scaling_type, linear.config.cast_config_weight.scaling_type,
               linear.config.cast_config_grad_output.scaling_type)
    granularity = {str(c.scaling_granularity) for c in (linear.config.cast_config_input,
                                                         linear.config.cast_config_weight,
                                                         linear.config.cast_config_grad_output)}
    if set(scaling) != {ScalingType.DYNAMIC} or granularity != {"ScalingGranularity.TENSORWISE"}:
        raise NotImplementedError(f"mixed_precision='fp8' with tensor parallelism takes torchao's dynamic tensorwise "
                                  f"scaling (the default recipe); this recipe scales {sorted(granularity)}")
    return (Float8ColwiseParallel if style == "colwise" else Float8RowwiseParallel)()
