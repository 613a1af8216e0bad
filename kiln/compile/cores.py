"""The cores this process may run on. Depends on the standard library only."""

from __future__ import annotations

import os


def free_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
