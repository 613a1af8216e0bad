"""Checkpoints: model weights with clean keys (weights.py), whole training states that survive a
crash and resume on another number of processes (training_state.py, sharded.py), folders that
Accelerate's save_state wrote (accelerate_folder.py), their integrity checks (integrity.py) and the
Accelerator's save_state/load_state side (api.py).

Depends on torch and safetensors at import; never on the facade or the compile package.
"""

from kiln.checkpoint.integrity import CheckpointCorruptError, CheckpointMismatchError
from kiln.checkpoint.weights import (clean_key, clean_state_dict, load_model, load_state_dict, parse_size,
                                     save_state_dict)

__all__ = ["CheckpointCorruptError", "CheckpointMismatchError", "clean_key", "clean_state_dict", "load_model",
           "load_state_dict", "parse_size", "save_state_dict"]
