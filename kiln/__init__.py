"""Kiln: fast PyTorch training through torch.compile, on one device or many.

The public names; each lives in the module named beside it.
"""

from kiln.accelerator import Accelerator
from kiln.buckets import BucketCollator
from kiln.checkpoint import load_model
from kiln.compile.regions import KilnCompileWarning, compile_regions, find_repeated_blocks
from kiln.compile.report import CompileReport, compile_report
from kiln.parallel.deepspeed import DeepSpeedPlugin
from kiln.parallel.fsdp import FullyShardedDataParallelPlugin
from kiln.plugins import DataLoaderConfiguration, TorchDynamoPlugin
from kiln.project import ProjectConfiguration
from kiln.state import DistributedType

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "BucketCollator",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin",
    "CompileReport",
    "DistributedType",
    "KilnCompileWarning",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "compile_regions",
    "compile_report",
    "find_repeated_blocks",
    "load_model",
]
