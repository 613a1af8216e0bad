"""One writer per artifact among the processes that share a cache folder: the first to create the
lock file beside the artifact (`<artifact>.lock`, made with O_EXCL) compiles and writes it; the
others wait for the artifact to appear, then load it.

Depends on the standard library only. A lock names its host, process id and creation time, so a
lock whose process died on this machine is taken over at once, and one from another machine (a
shared folder) is trusted for FOREIGN_LOCK_SECONDS.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path
from typing import Callable

LOCK_SUFFIX = ".lock"
POLL_SECONDS = 0.05
FOREIGN_LOCK_SECONDS = 600.0  # a lock held on another machine (shared folder) is trusted this long
TELL_EVERY_SECONDS = 30.0


def claim(artifact: Path) -> Path | None:
    """Create `artifact`'s lock file and return it; None when another live process holds it."""
    lock = artifact.with_suffix(LOCK_SUFFIX)
    artifact.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        if lock_is_stale(lock):
            lock.unlink(missing_ok=True)
            return claim(artifact)
        return None
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{socket.gethostname()} {os.getpid()} {time.time()} {secrets.token_hex(4)}\n")
    return lock


def wait_for(artifact: Path, tell: Callable[[float, Path], None]) -> tuple[bool, float]:
    """Wait while another process holds `artifact`'s lock; (whether the artifact appeared, seconds
    waited). `tell(seconds, lock)` is called every TELL_EVERY_SECONDS of waiting."""
    lock = artifact.with_suffix(LOCK_SUFFIX)
    start = told = time.perf_counter()
    while lock.exists() and not artifact.exists() and not lock_is_stale(lock):
        time.sleep(POLL_SECONDS)
        if time.perf_counter() - told > TELL_EVERY_SECONDS:
            told = time.perf_counter()
            tell(told - start, lock)
    return artifact.exists(), time.perf_counter() - start


def lock_is_stale(lock: Path) -> bool:
    """A lock whose process is gone (same machine), or an old one from another machine."""
    try:
        host, pid, created = lock.read_text().split()[:3]
    except (OSError, ValueError):
        return False  # being written, or just removed
    if host != socket.gethostname():
        return time.time() - float(created) > FOREIGN_LOCK_SECONDS
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
