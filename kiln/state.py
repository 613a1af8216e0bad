"""Process state: which process this is, how many there are, which device it drives, and the
process group that joins them.

Depends on torch only; never imports the facade. Any launcher that sets the usual variables
(WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: torchrun, `kiln launch`, DeepSpeed's)
works; without a GPU the processes talk over gloo on the CPU, no flag needed.
"""

from __future__ import annotations

import datetime
import enum
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600


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
    """Rank, world size and device of this process, read from the launcher's environment.

    With WORLD_SIZE > 1 it joins (or reuses) the default process group: NCCL when this process has
    a GPU, gloo otherwise. `KILN_PROCESS_GROUP_TIMEOUT` (seconds, default 600) bounds how long a
    collective waits for a process that died, so the others exit with an error instead of hanging.
    """

    def __init__(self, cpu: bool = False) -> None:
        self.num_processes = int(os.environ.get("WORLD_SIZE", "1"))
        self.process_index = int(os.environ.get("RANK", "0"))
        self.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"RANK={self.process_index} is outside WORLD_SIZE={self.num_processes}")
        self.device = self._pick_device(cpu)
        if self.num_processes > 1:
            self._join_process_group()
            self.distributed_type = DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU
        else:
            self.distributed_type = DistributedType.NO

    def _pick_device(self, cpu: bool) -> torch.device:
        if not cpu and torch.cuda.is_available():
            device = torch.device("cuda", self.local_process_index % torch.cuda.device_count())
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def _join_process_group(self) -> None:
        if dist.is_initialized():
            if dist.get_world_size() != self.num_processes:
                raise RuntimeError(f"a process group of {dist.get_world_size()} processes exists, "
                                   f"but WORLD_SIZE is {self.num_processes}")
            return
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(f"WORLD_SIZE={self.num_processes} but {name} is not set; start the "
                                   "processes with `kiln launch` or torchrun, which set it")
        timeout = float(os.environ.get("KILN_PROCESS_GROUP_TIMEOUT", DEFAULT_TIMEOUT_S))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout),
                                rank=self.process_index, world_size=self.num_processes)

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

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
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def end(self) -> None:
        """Leave the process group (the end of a run); safe to call twice."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
