"""Reading a checkpoint's pickled files without running code they might carry: tensors and plain containers
only, and the few numpy pieces an RNG state needs, named.

Depends on torch and the standard library only (numpy where installed); never on the rest of Kiln.

Kiln's folders and Accelerate's hold optimizer, scheduler and gradient-scaler states and RNG states in
torch's (or Python's) pickle format. Pickle can call any function while it reads; torch's weights-only
reader allows tensors and plain containers only. What a user registers for checkpointing may hold any
object, so those files alone are read with the full pickle reader, as Accelerate reads them
(docs/checkpoints.md#trust).
"""

from __future__ import annotations

import codecs
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch


def load_state_file(path: Path) -> Any:
    """An optimizer's, scheduler's or scaler's saved state: tensors and plain containers, nothing else."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_any_object(path: Path) -> Any:
    """A registered object's saved state, which may hold any Python object: the full pickle reader."""
    return torch.load(path, map_location="cpu", weights_only=False)


def numpy_rng_globals() -> list[Any]:
    """What numpy's RNG state (a tuple holding a uint32 array) needs beyond plain containers."""
    try:
        import numpy
    except ImportError:
        return []
    allowed = [numpy.ndarray, numpy.dtype, codecs.encode, getattr(numpy, "_core", numpy).multiarray._reconstruct]
    if hasattr(numpy, "dtypes"):
        allowed.append(numpy.dtypes.UInt32DType)
    return allowed


def load_rng_file(path: Path) -> Any:
    """RNG states written with torch.save (Kiln since its signed compile artifacts, and Accelerate), or
    with plain pickle (earlier Kiln): tensors, plain containers and numpy's RNG arrays only."""
    if zipfile.is_zipfile(path):
        with torch.serialization.safe_globals(numpy_rng_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    with open(path, "rb") as handle:
        return _RngUnpickler(handle).load()


class _RngUnpickler(pickle.Unpickler):
    """An earlier Kiln's `pickle.dump` of its RNG states: the globals such a file names, and no other.
    A tensor inside is rebuilt from its bytes by torch's weights-only reader instead of the full one
    that `torch.storage._load_from_bytes` would use."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _tensor_storage_from_bytes
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")):
            return super().find_class(module, name)
        for allowed in numpy_rng_globals():
            if (module.replace("numpy.core", "numpy._core"), name) == (
                    getattr(allowed, "__module__", "").replace("numpy.core", "numpy._core"), allowed.__name__):
                return allowed
        raise pickle.UnpicklingError(f"the file names {module}.{name}, which an RNG state never holds; "
                                     "it was not written by Kiln's save_state")


def _tensor_storage_from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)
