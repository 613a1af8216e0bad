"""`get_logger`: a logger that speaks on the main process only unless told otherwise.

Depends on the standard library only (the process index comes from the launcher's environment).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any


class ProcessAwareLogger(logging.LoggerAdapter):
    """`logger.info(msg, main_process_only=False)` logs on every process; the default, on rank 0 only.
    `in_order=True` (with main_process_only=False) logs process by process, in rank order (a
    collective: call it on every process)."""

    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True, in_order: bool = False,
            **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        rank = int(os.environ.get("RANK", "0"))
        if main_process_only:
            if rank == 0:
                self._emit(level, msg, args, kwargs)
            return
        if not in_order:
            self._emit(level, msg, args, kwargs)
            return
        import torch.distributed as dist

        turns = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        for turn in range(turns):
            if turn == rank:
                self._emit(level, msg, args, kwargs)
            if turns > 1:
                dist.barrier()

    def _emit(self, level: int, msg: Any, args: tuple, kwargs: dict) -> None:
        msg, kwargs = self.process(msg, kwargs)
        self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019 (one entry per message, for the life of the logger)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, once per distinct message."""
        self.warning(*args, **kwargs)

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> ProcessAwareLogger:
    """Like `accelerate.logging.get_logger`: `KILN_LOG_LEVEL` sets the level when `log_level` is None."""
    logger = logging.getLogger(name)
    level = log_level if log_level is not None else os.environ.get("KILN_LOG_LEVEL")
    if level is not None:
        logger.setLevel(level.upper() if isinstance(level, str) else level)
    return ProcessAwareLogger(logger, {})
