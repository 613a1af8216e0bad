"""The process side of the Accelerator: who this process is, and collectives over all of them.

Depends on torch, kiln.state and kiln.collectives only; `Accelerator` builds on it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from kiln import collectives
from kiln.accumulation import GradientState
from kiln.state import DistributedType, ProcessState


class ProcessAPI:
    """Process facts and cross-process helpers; needs `self.state` and `self.gradient_state`."""

    state: ProcessState
    gradient_state: GradientState

    # ----- process facts -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def gather(self, tensor: Any) -> Any:
        """Each tensor concatenated along dim 0 over the processes, in rank order."""
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the samples repeated at the end of an epoch to even out the processes,
        so an evaluation loop sees each sample of the dataset exactly once."""
        # Under tensor or context parallelism the processes of one `cp` x `tp` group (consecutive
        # ranks: the innermost mesh dimensions) read the same batches.
        config = getattr(self, "parallelism_config", None)
        every = config.non_data_parallel_size if config is not None else 1
        if use_gather_object or not collectives.holds_tensors(input_data):
            parts = collectives.gather_object(input_data)[::every]
            gathered = [x for part in parts for x in (part if isinstance(part, list) else [part])]
        else:
            gathered = collectives.gather(input_data, every)
        loader = self.gradient_state.active_dataloader
        padded = loader.padded_samples if loader is not None and self.gradient_state.end_of_dataloader else 0
        if padded:
            trim = lambda t: t[: len(t) - padded]  # noqa: E731
            gathered = trim(gathered) if isinstance(gathered, list) else collectives.apply_to_tensors(gathered, trim)
        return gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, dict of lists, or tensor (dim 0)."""
        yield collectives.split_between(inputs, self.num_processes, self.process_index, apply_padding)

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """The main process runs the block first (say, to download or cache), then the others."""
        return self._goes_first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        """On each machine, its first process runs the block first, then the others."""
        return self._goes_first(self.is_local_main_process)

    @contextlib.contextmanager
    def _goes_first(self, first: bool) -> Iterator[None]:
        """The processes where `first` holds run the block, then the others (one barrier between)."""
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def set_trigger(self) -> None:
        """Raise this process's flag; `check_trigger` on every process then sees it (early stopping)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called `set_trigger` since the last check (a collective:
        call it on every process); the flag is lowered again."""
        raised = collectives.reduce(torch.tensor([1.0 if getattr(self, "_trigger", False) else 0.0],
                                                 device=self.device), "sum")
        self._trigger = False
        return bool(raised.item() > 0)

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: the function runs on the main process only (returns None elsewhere)."""
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None
        return wrapper
