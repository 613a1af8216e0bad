"""Experiment trackers behind `init_trackers` / `log`: JSON lines always available, TensorBoard
when installed.

Depends on the standard library (and torch.utils.tensorboard for the TensorBoard tracker).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class JSONLinesTracker:
    """One JSON object per `log` call in `<project_dir>/<run>/metrics.jsonl`, the config beside it."""

    name = "jsonl"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, config: dict[str, Any] | None = None) -> None:
        self.folder = Path(logging_dir) / run_name
        self.folder.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (self.folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self._file = open(self.folder / "metrics.jsonl", "a", buffering=1)

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        record = {"time": time.time(), "step": step, **{k: _plain(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")

    def finish(self) -> None:
        self._file.close()


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, config: dict[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(logging_dir) / run_name))
        if config is not None:
            self.writer.add_text("config", json.dumps(config, indent=2, default=str))

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        for key, value in values.items():
            value = _plain(value)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step)
            else:
                self.writer.add_text(key, str(value), global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


TRACKERS = {"jsonl": JSONLinesTracker, "tensorboard": TensorBoardTracker}


def check_log_with(log_with: str | list[str] | None) -> list[str]:
    """The tracker names asked for; unknown names are an error listing the choices."""
    if log_with is None:
        return []
    names = [log_with] if isinstance(log_with, str) else list(log_with)
    if "all" in names:
        names = ["jsonl"] + (["tensorboard"] if _tensorboard_available() else [])
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}; choose from: {', '.join(TRACKERS)}, all")
    if "tensorboard" in names and not _tensorboard_available():
        raise ValueError("log_with='tensorboard' needs the tensorboard package: pip install tensorboard")
    return names


def _tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            return str(value)
    return value
