"""Process state: which process this is, how many there are, which device it drives, and the
process group that joins them.

Depends on torch only; never imports the facade. Any launcher that sets the usual variables
(WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: torchrun, `kiln launch`, DeepSpeed's)
works; without a GPU the processes talk over gloo on the CPU, no flag needed.
"""

from __future__ import annotations

import atexit
import datetime
import enum
import os
import time

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600


class DistributedType(str, enum.Enum):
    """How the processes of a run share the work (the names Accelerate scripts compare against)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    # Kiln never runs these; they exist so that scripts comparing against them read as in Accelerate.
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"


class ProcessState:
    """Rank, world size and device of this process, read from the launcher's environment.

    With WORLD_SIZE > 1 it joins (or reuses) the default process group: NCCL when this process has
    a GPU, gloo otherwise. `KILN_PROCESS_GROUP_TIMEOUT` (seconds, default 600) bounds how long a
    collective waits for a process that died, so the others exit with an error instead of hanging.
    """

    def __init__(self, cpu: bool = False, backend: str | None = None, init_method: str | None = None,
                 timeout: datetime.timedelta | None = None) -> None:
        self.backend_asked, self.init_method, self.timeout = backend, init_method, timeout
        # Set by the Accelerator that owns this state (AcceleratorState's fields in Accelerate).
        self.mixed_precision = "no"
        self.deepspeed_plugin: object | None = None
        self.fsdp_plugin: object | None = None
        self.dynamo_plugin: object | None = None
        self.parallelism_config: object | None = None
        self.device_mesh: object | None = None  # the ParallelismConfig's, under Accelerate's dimension names
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
        timeout = self.timeout or datetime.timedelta(
            seconds=float(os.environ.get("KILN_PROCESS_GROUP_TIMEOUT", DEFAULT_TIMEOUT_S)))
        backend = self.backend_asked or ("nccl" if self.device.type == "cuda" else "gloo")
        dist.init_process_group(backend, init_method=self.init_method, timeout=timeout,
                                rank=self.process_index, world_size=self.num_processes,
                                store=self._restart_store(timeout))
        global _KILN_GROUP
        _KILN_GROUP = dist.group.WORLD  # left by end_training(), else at exit

    def _restart_store(self, timeout: datetime.timedelta) -> dist.Store | None:
        """After an elastic restart, the launcher's store under a prefix of this attempt. torchrun's
        agent keeps one store across restarts, and the keys the failed attempt's processes wrote
        stay in it: a restarted process could read a dead one's address (gloo: "connectFullMesh
        failed ... Connection refused", torch 2.13). None otherwise: torch's own rendezvous."""
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if self.init_method is not None or attempt == "0":
            return None
        hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.num_processes,
                              is_master=not hosted_by_agent and self.process_index == 0, timeout=timeout)
        return dist.PrefixStore(f"kiln/attempt_{attempt}", store)

    @property
    def backend(self) -> str | None:
        return dist.get_backend() if dist.is_available() and dist.is_initialized() else None

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    def __repr__(self) -> str:
        """As Accelerate's AcceleratorState prints itself (scripts log `accelerator.state`)."""
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: {self.distributed_type.value}{backend}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
                f"Mixed precision type: {self.mixed_precision}\n")

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
        """Leave the process group if Kiln started it (the end of a run); safe to call twice. A group
        the user started before the Accelerator is theirs to end."""
        _leave_process_group()


_KILN_GROUP = None  # the default process group Kiln started, while it is up


def _leave_process_group() -> None:
    """Destroy the group Kiln started, once its threads are idle.

    Seen with gloo, torch 2.13: a collective's work object can be freed on gloo's own thread just
    after the collective returns, and freeing it takes the GIL (it holds tensors Python made). If
    the group is torn down then, the main thread joins that thread while holding the GIL (a
    deadlock), or Python is finalising (an abort). A short sleep releases the GIL and lets it finish.
    """
    global _KILN_GROUP
    if _KILN_GROUP is not None and dist.is_initialized() and dist.group.WORLD is _KILN_GROUP:
        time.sleep(0.2)
        dist.destroy_process_group()
    _KILN_GROUP = None


# A group still up at interpreter exit can abort a finished run ("terminate called without an
# active exception", gloo, torch 2.13): leave it at exit when end_training() did not.
atexit.register(_leave_process_group)

_CURRENT: ProcessState | None = None  # the state of the last Accelerator made in this process


def set_current(state: ProcessState) -> None:
    global _CURRENT
    _CURRENT = state


def is_initialized() -> bool:
    """Whether an Accelerator exists in this process (`accelerate.state.is_initialized`)."""
    return _CURRENT is not None


def AcceleratorState() -> ProcessState:  # noqa: N802 (Accelerate's class name; here it reads the shared state)
    """The state of this process's Accelerator: distributed type, processes, device, mixed
    precision, the DeepSpeed and FSDP plugins. An error before any Accelerator was made."""
    if _CURRENT is None:
        raise RuntimeError("AcceleratorState() reads the state of an Accelerator, and none was made yet: "
                           "create the Accelerator first (or check kiln.state.is_initialized())")
    return _CURRENT


def PartialState(cpu: bool = False) -> ProcessState:  # noqa: N802
    """The process facts (rank, world size, device) without an Accelerator: the Accelerator's state
    when one exists, else a new one (which joins the process group under a launcher)."""
    if _CURRENT is not None:
        return _CURRENT
    state = ProcessState(cpu=cpu)
    set_current(state)
    return state
