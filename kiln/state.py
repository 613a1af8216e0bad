"""Process state: which process this is, how many there are, which device it drives.

Depends on torch only; never imports the facade.
"""

from __future__ import annotations

import enum
import os

import torch


class DistributedType(str, enum.Enum):
    """How the processes of a run share the work (the names Accelerate scripts compare against)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_XPU = "MULTI_XPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    XLA = "XLA"


class ProcessState:
    """Rank, world size and device of this process, read from the launcher's environment."""

    def __init__(self, cpu: bool = False) -> None:
        self.num_processes = int(os.environ.get("WORLD_SIZE", "1"))
        self.process_index = int(os.environ.get("RANK", "0"))
        self.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))
        if self.num_processes > 1:
            raise RuntimeError(
                f"this process was launched as rank {self.process_index} of {self.num_processes} "
                "(WORLD_SIZE is set), but this Kiln version trains on one process only; "
                "unset WORLD_SIZE or launch a single process"
            )
        self.distributed_type = DistributedType.NO
        self.device = self._pick_device(cpu)

    def _pick_device(self, cpu: bool) -> torch.device:
        if not cpu and torch.cuda.is_available():
            return torch.device("cuda", self.local_process_index)
        return torch.device("cpu")

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
