"""Context parallelism: the processes of a `cp` group each hold a slice of every sequence, and
attention runs as ring attention over the group (torch's experimental `context_parallel`).

Depends on torch only. The Accelerator's `maybe_context_parallel` enters `context_parallel_region`
around a step; when the FSDP2 strategy prepares the model it checks it (`check_model`) and hooks it
(`check_inputs_under_context_parallel`, `drop_block_masks`), the hooks acting inside regions only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

COMM_STRATEGIES = ("allgather", "alltoall")
ENV_COMM_STRATEGY = "PARALLELISM_CONFIG_CP_COMM_STRATEGY"


@dataclass
class TorchContextParallelConfig:
    """How a context-parallel group passes keys and values round, as Accelerate's class of the same
    name: "allgather" (each process gathers every slice once; torch's default) or "alltoall"
    (passed one step at a time, less memory). None reads `PARALLELISM_CONFIG_CP_COMM_STRATEGY`,
    else "allgather"."""

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get(ENV_COMM_STRATEGY, "allgather")
        if self.cp_comm_strategy not in COMM_STRATEGIES:
            raise ValueError(f"cp_comm_strategy must be one of {', '.join(COMM_STRATEGIES)}, "
                             f"not {self.cp_comm_strategy!r}")


def check_model(model: nn.Module) -> None:
    """Refuse a model whose attention would silently see only this process's slice: context
    parallelism replaces `scaled_dot_product_attention`, so attention written out in matmuls (a
    transformers model loaded with attn_implementation="eager") attends within the slice alone, and
    a model that says it does not support it (transformers' `supports_context_parallel`, set for
    sliding-window, chunked and recurrent layers) would be trained with the wrong mask."""
    if getattr(model, "supports_context_parallel", True) is False:
        raise ValueError(f"{type(model).__name__} does not support context parallelism (its "
                         "supports_context_parallel is False): its layers need a mask or a state that ring "
                         "attention does not carry between processes. Set cp_size=1")
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation != "sdpa":
        raise ValueError(f"context parallelism runs attention through torch's scaled_dot_product_attention, "
                         f"but this model's attention is {implementation!r}, which would attend within each "
                         "process's slice of the sequence only: load it with attn_implementation=\"sdpa\"")


@contextlib.contextmanager
def context_parallel_region(mesh: Any, buffers: list[torch.Tensor], seq_dims: list[int],
                            no_restore: set[torch.Tensor], comm_strategy: str) -> Iterator[None]:
    """Shard `buffers` in place along their sequence dimensions over `mesh` (each process keeps two
    chunks, one from each end, so causal work is balanced), and run every
    `scaled_dot_product_attention` inside as ring attention; the buffers not in `no_restore` are
    whole again afterwards. Forward and backward both belong inside."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    global _regions_open
    _check_buffers(buffers, seq_dims, no_restore, mesh.size())
    if mesh.device_type == "cpu":
        _enable_cpu_ring_attention()
    _set_rotate_method(comm_strategy)
    # The math kernel is never right here: on sliced sequences it would build its causal mask from
    # the slices' own positions. Left out, a call it would have taken fails instead.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]), \
            context_parallel(mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims),
                             no_restore_buffers=set(no_restore)), \
            _causal_attention():
        _regions_open += 1
        try:
            yield
        finally:
            _regions_open -= 1


def _check_buffers(buffers: Any, seq_dims: Any, no_restore: Any, cp_size: int) -> None:
    if not isinstance(buffers, (list, tuple)) or not all(isinstance(b, torch.Tensor) for b in buffers):
        raise TypeError("maybe_context_parallel's buffers must be a list of tensors (the inputs, labels and "
                        f"position ids to slice along the sequence), not {type(buffers).__name__}")
    if not buffers:
        raise ValueError("maybe_context_parallel needs the buffers to slice (at least the input ids)")
    if not isinstance(seq_dims, (list, tuple)) or len(seq_dims) != len(buffers):
        raise ValueError(f"buffer_seq_dims must give one sequence dimension per buffer ({len(buffers)} buffers), "
                         f"not {seq_dims!r}")
    lengths = {b.shape[d] for b, d in zip(buffers, seq_dims)}
    if len(lengths) != 1:
        raise ValueError(f"the buffers' sequence lengths differ ({sorted(lengths)}): every buffer must be "
                         "sliced alike")
    length = lengths.pop()
    if length % (2 * cp_size):
        raise ValueError(f"the sequence length {length} must divide by 2 x cp_size = {2 * cp_size}: each process "
                         "takes one chunk from each end of the sequence. Pad the sequences to a multiple")
    for buffer in buffers:
        if isinstance(buffer, nn.Parameter) or buffer.requires_grad:
            raise ValueError("a buffer of maybe_context_parallel requires grad: it is sliced in place, so pass "
                             "the inputs, labels and positions, not parameters or activations")
    if not all(any(b is kept for b in buffers) for kept in no_restore):
        raise ValueError("no_restore_buffers must be a subset of buffers")


def _set_rotate_method(comm_strategy: str) -> None:
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(comm_strategy)


_MASK_ERROR = ("scaled_dot_product_attention got an attention mask inside maybe_context_parallel: ring "
               "attention is causal over whole sequences and takes no mask")


@contextlib.contextmanager
def _causal_attention() -> Iterator[None]:
    """Every attention call inside is full causal attention without a mask (ring attention takes
    none; the blocks' masks were dropped by `drop_block_masks`, so one that still arrives is
    refused). Entered inside torch's context_parallel, so it wraps torch's replacement and is taken
    off before torch restores the original."""
    import torch.nn.functional as F

    ring = F.scaled_dot_product_attention

    @functools.wraps(ring)
    def causal(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, **kwargs: Any) -> Any:
        if attn_mask is not None:
            raise ValueError(_MASK_ERROR)
        return ring(query, key, value, dropout_p=dropout_p, is_causal=True, **kwargs)

    F.scaled_dot_product_attention = causal
    try:
        yield
    finally:
        F.scaled_dot_product_attention = ring


_regions_open = 0  # context-parallel regions now open (read by the hooks below)


def drop_block_masks(model: nn.Module, block_paths: list[str]) -> None:
    """Inside maybe_context_parallel, each block is called without the attention mask the model
    made for it. A transformers model makes that mask from the slice of positions each process
    holds, so it differs from process to process (the head-and-tail slices of one look like packed
    sequences, the middle slice of another does not), and so would the attention's key and value
    layout (grouped-query heads repeated or not): the processes' collectives would no longer match.
    Without it, every block runs full causal attention, which is what the sequences mean here
    (padding is refused by `check_inputs_under_context_parallel`)."""

    def drop(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not _regions_open or kwargs.get("attention_mask") is None:
            return None
        return args, {**kwargs, "attention_mask": None}

    for path in block_paths:
        model.get_submodule(path).register_forward_pre_hook(drop, with_kwargs=True)


def check_inputs_under_context_parallel(model: nn.Module) -> None:
    """Inside maybe_context_parallel, refuse what a slice of the sequence cannot honour: a padding
    attention mask (all ones is fine), and, for a model that takes `position_ids`, none given
    (it would number each slice from 0, so every process but the first rotates with the wrong
    positions)."""
    import inspect

    takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not _regions_open:
            return
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("the model got an attention mask with padding inside maybe_context_parallel: ring "
                             "attention is causal over whole sequences, so pack or trim them instead of padding")
        if takes_positions and kwargs.get("position_ids") is None:
            raise ValueError(f"{type(module).__name__} takes position_ids, and inside maybe_context_parallel it "
                             "must get them: pass position_ids (torch.arange of the whole sequence) and list them "
                             "among the buffers, so that each process rotates its slice by its true positions")

    model.register_forward_pre_hook(check, with_kwargs=True)


# ----- ring attention on the CPU --------------------------------------------------------------
# torch (2.7 to 2.14) sends the sliced queries, keys and values of `scaled_dot_product_attention`
# to ring attention for its CUDA kernels only (flash, efficient, cuDNN); on the CPU the call reaches
# `_scaled_dot_product_flash_attention_for_cpu`, which has no handler and fails ("does not have a
# sharding strategy registered"). That kernel returns (output, logsumexp) as CUDA's flash kernel
# does, and its backward takes the same named arguments, so torch's ring templates run it as they
# are. Kiln adds the two handlers to torch's table, behind a check that the private names exist.
_cpu_ring_lock = threading.Lock()


def _enable_cpu_ring_attention() -> None:
    with _cpu_ring_lock:
        attention = _torch_cp_attention()
        aten = torch.ops.aten
        if attention is None or not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            raise NotImplementedError(
                f"context parallelism on the CPU needs torch's ring-attention internals (custom_ops, "
                f"_templated_ring_attention), which this torch ({torch.__version__}) lacks: train on CUDA, "
                "or set cp_size=1")
        attention.custom_ops.setdefault(aten._scaled_dot_product_flash_attention_for_cpu.default, _cpu_ring_forward)
        attention.custom_ops.setdefault(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                                        _cpu_ring_backward)


@functools.cache  # looked up by each attention call's handler: once is enough
def _torch_cp_attention() -> Any:
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        return None
    names = ("custom_ops", "_templated_ring_attention", "_templated_ring_attention_backward")
    return _attention if all(hasattr(_attention, n) for n in names) else None


def _local(tensor: Any) -> Any:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _sliced(tensors: Any, mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)


def _cpu_ring_forward(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """`_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, *,
    attn_mask, scale)` on sequence-sliced DTensors: (output, logsumexp), sliced alike."""
    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:  # ring attention has no mask to slice; never drop one silently
        raise ValueError(_MASK_ERROR)
    mesh = query.device_mesh
    outputs = _torch_cp_attention()._templated_ring_attention(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        query=_local(query), key=_local(key), value=_local(value), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return _sliced(outputs[:2], mesh)


def _cpu_ring_backward(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """Its backward, `(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
    attn_mask, scale)`: the gradients of query, key and value."""
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    mesh = query.device_mesh
    grads = _torch_cp_attention()._templated_ring_attention_backward(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=_local(grad_out), grad_out_name="grad_out", query=_local(query), key=_local(key),
        value=_local(value), out=_local(out), logsumexp=_local(logsumexp), is_causal=is_causal,
        dropout_p=dropout_p, scale=kwargs.get("scale"))
    return _sliced(grads[:3], mesh)
