"""Accelerate's import path for `ParallelismConfig` (`from accelerate.parallelism_config import ...`).

Depends on kiln.parallel.parallelism_config only, where it lives.
"""

from kiln.parallel.parallelism_config import ParallelismConfig

__all__ = ["ParallelismConfig"]
