"""Kiln: fast PyTorch training through torch.compile, on one device or many.

The public names; each lives in the module named beside it. The top-level names of Accelerate that
scripts import (`from accelerate import ...`) are here too.
"""

from kiln.accelerator import Accelerator
from kiln.buckets import BucketCollator
from kiln.checkpoint import CheckpointCorruptError, CheckpointMismatchError, load_model
from kiln.checkpoint.training_state import LoadReport
from kiln.empty_init import init_empty_weights, init_on_device
from kiln.compile.regions import KilnCompileWarning, compile_regions, find_repeated_blocks
from kiln.compile.report import CompileReport, compile_report
from kiln.data import KilnResumeWarning, skip_first_batches
from kiln.kwargs_handlers import (AutocastKwargs, DDPCommunicationHookType, DistributedDataParallelKwargs,
                                  GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)
from kiln.parallel.deepspeed import DeepSpeedPlugin
from kiln.parallel.fsdp import FullyShardedDataParallelPlugin
from kiln.parallel.parallelism_config import ParallelismConfig
from kiln.plugins import DataLoaderConfiguration, TorchDynamoPlugin
from kiln.project import ProjectConfiguration
from kiln.state import AcceleratorState, DistributedType, PartialState
from kiln.utils import find_executable_batch_size

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "BucketCollator",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CompileReport",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "ParallelismConfig",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "LoadReport",
    "KilnCompileWarning",
    "KilnResumeWarning",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "compile_regions",
    "compile_report",
    "find_executable_batch_size",
    "find_repeated_blocks",
    "init_empty_weights",
    "init_on_device",
    "load_model",
    "skip_first_batches",
]
