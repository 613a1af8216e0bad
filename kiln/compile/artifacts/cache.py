"""Warm starts: keep what torch.compile built on disk, so the next run of the same job skips the cold compile.

Depends on torch, kiln.plugins (its boolean parser) and kiln.compile.artifacts.cache_key only; never on the
facade, a strategy or the rest of the compile package.

Two things survive a process, both under one folder (default ~/.cache/kiln/compile):
- `inductor/`: Inductor's own disk cache (FX graphs, AOTAutograd entries, built C++/Triton kernels),
  reached through TORCHINDUCTOR_CACHE_DIR. On a CPU this is what makes a warm start fast: the built
  kernels are there and gcc does not run again.
- `<key>.kiln`: the bytes of `torch.compiler.save_cache_artifacts()` (FX graph and AOTAutograd
  entries, not built kernels) in a checked envelope, for `load_cache_artifacts()` to refill a fresh
  Inductor folder (another machine, a wiped /tmp). Layout: the MAGIC line, one JSON header line
  (format, key, versions, created, payload_sha256, payload_bytes, description), then the payload.
Beside them, `progress/<key>.json` records the graphs and seconds of the job's last compile, for the
live compile line's estimate (kiln/compile/progress.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from kiln.compile.artifacts.cache_key import canonical_json, job_key, triton_version
from kiln.compile.artifacts.trust import KilnTrustWarning, folder_problem, make_private_folder
from kiln.plugins import parse_bool

MAGIC = b"KILN-COMPILE-CACHE\n"
FORMAT_VERSION = 1
ENTRY_SUFFIX = ".kiln"
TEMP_PREFIX = ".tmp-"
ENV_DIR = "KILN_COMPILE_CACHE_DIR"
ENV_ENABLED = "KILN_COMPILE_CACHE"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_DIR = "~/.cache/kiln/compile"
MAX_HEADER_BYTES = 64 * 1024
# The TORCHINDUCTOR_CACHE_DIR value Kiln last wrote in this process, so a second CompileCache can
# tell Kiln's own setting (which it may move) from the user's (which it must keep).
_kiln_inductor_dir: str | None = None


class KilnCacheWarning(UserWarning):
    """A compile-cache entry could not be used or written; the compile runs cold instead."""


class CorruptEntryError(ValueError):
    """An entry file that is not a complete, consistent Kiln cache entry; says what is wrong."""


@dataclass
class CacheStats:
    """What the cache did in this process, for the compile report."""

    hits: int = 0
    misses: int = 0  # no entry, or an entry that could not be used
    saves: int = 0  # entry files written
    rejected: int = 0  # entries found but unusable (each also warned about and counted as a miss)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class CacheEntryInfo:
    """One entry file as `kiln cache ls` shows it; `problem` is set (and the rest may be None) when
    the file is not a usable entry."""

    file: Path
    size: int
    created: float | None
    description: str
    torch_version: str | None
    key: str | None = None
    problem: str | None = None

    @property
    def corrupt(self) -> bool:
        return self.problem is not None


class CompileCache:
    """Saves and loads compiled artifacts by a key over everything that makes them valid.

    Typical use, around the first compiled step:

    >>> cache = CompileCache()                       # ~/.cache/kiln/compile, or KILN_COMPILE_CACHE_DIR
    >>> cache.activate()                             # Inductor's disk cache goes under it too
    >>> key = cache.key(model, {"backend": "inductor", "mode": None}, torch.device("cpu"))
    >>> cache.load(key)                              # True on a warm start
    >>> ...compile, run the first step...
    >>> cache.save(key)                              # rank 0 only (is_writer)
    """

    def __init__(self, directory: str | os.PathLike | None = None, enabled: bool | None = None,
                 is_writer: bool = True) -> None:
        if directory is None:
            directory = os.environ.get(ENV_DIR) or DEFAULT_DIR
        if enabled is None:
            value = os.environ.get(ENV_ENABLED)
            enabled = True if value is None else parse_bool(value, ENV_ENABLED)
        self.directory = Path(directory).expanduser().absolute()
        self.enabled = bool(enabled)
        self.is_writer = is_writer
        self.stats = CacheStats()
        self.inductor_dir_source: str | None = None  # "kiln" or "user" once activated
        self._descriptions: dict[str, str] = {}  # key -> the line `kiln cache ls` shows
        # torch's cache keys of the artifacts this process saved or loaded, by kind ("inductor",
        # "aot_autograd", ...): which of Inductor's cache entries the job's compiled code came from.
        self.artifact_keys: dict[str, set[str]] = {}

    def __repr__(self) -> str:
        return (f"CompileCache(directory={str(self.directory)!r}, enabled={self.enabled}, "
                f"is_writer={self.is_writer})")

    # ----- Inductor's own disk cache --------------------------------------------------------
    @property
    def inductor_dir(self) -> Path:
        """The Inductor folder Kiln owns (the one `clear` removes); see `inductor_dir_in_use`."""
        return self.directory / "inductor"

    @property
    def precompiled_dir(self) -> Path:
        """Where precompiled regions keep their artifacts (kiln/compile/artifacts/precompiled.py)."""
        return self.directory / "precompiled"

    @property
    def progress_dir(self) -> Path:
        """Where each job's last compile record lives (graphs and seconds; kiln/compile/progress.py)."""
        return self.directory / "progress"

    @property
    def manifest_dir(self) -> Path:
        """Where each job's record of its compiled files lives (kiln/compile/artifacts/manifest.py)."""
        return self.directory / "manifests"

    @property
    def quarantine_dir(self) -> Path:
        """Where compiled files that changed since they were recorded are moved (manifest.py)."""
        return self.directory / "quarantine"

    @property
    def inductor_dir_in_use(self) -> Path:
        """Where Inductor caches now: the user's TORCHINDUCTOR_CACHE_DIR if set, else Kiln's folder."""
        if self.inductor_dir_source == "user":
            return Path(os.environ[INDUCTOR_ENV])
        return self.inductor_dir

    def activate(self) -> None:
        """Point Inductor's disk cache at `<directory>/inductor`, unless the user chose a folder.

        Kiln's folders are made owner-only; one that another user owns or can write to (Kiln's, or the
        user's Inductor folder) disables the cache with one KilnTrustWarning: compiled code is loaded
        from there. Idempotent; does nothing when disabled. Call before the first compile of the process.
        """
        global _kiln_inductor_dir
        if not self.enabled:
            return
        current = os.environ.get(INDUCTOR_ENV)
        users = bool(current) and not _set_by_kiln_or_torch(current, self.inductor_dir)
        inductor = Path(current) if users else self.inductor_dir
        # Compiled code is loaded from these folders: each is refused where another user could write into
        # it, and checked before Kiln makes anything inside it.
        for folder, what, make in ((self.directory, "the Kiln cache folder", True),
                                   (inductor, f"the Inductor folder {INDUCTOR_ENV} names" if users
                                    else "Kiln's Inductor folder", not users)):
            try:
                if make:
                    make_private_folder(folder)
            except OSError as exc:
                warnings.warn(f"compile cache disabled: cannot create {folder} ({exc}); "
                              f"set {ENV_DIR} to a writable folder", KilnCacheWarning, stacklevel=2)
                self.enabled = False
                return
            problem = folder_problem(folder)
            if problem is not None:
                still = f" (Inductor itself still uses it, as {INDUCTOR_ENV} asks)" if not make and users else ""
                warnings.warn(f"compile cache disabled: {what} {folder} is refused because {problem}. Kiln loads "
                              f"and installs no compiled code there{still} and compiles cold; make it yours alone "
                              f"(chmod go-w {folder}) or set {ENV_DIR} to a folder of your own", KilnTrustWarning,
                              stacklevel=2)
                self.enabled = False
                return
        if users:
            self.inductor_dir_source = "user"
            return
        os.environ[INDUCTOR_ENV] = _kiln_inductor_dir = str(self.inductor_dir)
        self.inductor_dir_source = "kiln"

    # ----- keys ----------------------------------------------------------------------------
    def key(self, model: nn.Module, compile_kwargs: dict[str, Any], device: torch.device | str) -> str:
        """A hex digest over everything that decides whether saved artifacts fit this job.

        Covers torch, triton and python versions, the device type and name, the compile settings
        (backend, mode, options, fullgraph, dynamic, and mixed precision under "precision") and
        the model's structure (module classes, parameter and buffer names, shapes and dtypes).
        The same job gives the same key in every process.
        """
        key, description = job_key(model, compile_kwargs, device, FORMAT_VERSION)
        self._descriptions[key] = description
        return key

    def entry_path(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{16,128}", key):
            raise ValueError(f"cache key {key!r} is not a hex digest; use CompileCache.key(...) to make one")
        return self.directory / f"{key}{ENTRY_SUFFIX}"

    # ----- load and save -------------------------------------------------------------------
    def load(self, key: str) -> bool:
        """Load the artifacts saved under `key` into torch's caches; True on a hit.

        No entry is a silent miss. An unusable entry gives one KilnCacheWarning saying which file
        and why, and a miss: the compile then runs cold. Never raises for a bad entry.
        """
        if not self.enabled:
            return False
        self.activate()  # load_cache_artifacts writes into Inductor's folder: it must be ours by now
        path = self.entry_path(key)
        try:
            header, payload = read_entry(path)
            if header["key"] != key:
                raise CorruptEntryError(f"it was saved under key {header['key']!r}, not the requested {key!r}")
            if header.get("torch") != torch.__version__:
                raise CorruptEntryError(f"it was written by torch {header.get('torch')}, this is torch "
                                        f"{torch.__version__}")
            try:
                info = torch.compiler.load_cache_artifacts(payload)
            except Exception as exc:  # torch's own deserializer failing must not stop the job
                raise CorruptEntryError(f"torch.compiler.load_cache_artifacts raised "
                                        f"{type(exc).__name__}: {exc}") from None
            if info is None:
                raise CorruptEntryError("torch.compiler.load_cache_artifacts could not read the artifacts")
            self._note_artifacts(getattr(info, "artifacts", None))
        except FileNotFoundError:
            self.stats.misses += 1
            return False
        except (CorruptEntryError, OSError) as exc:
            self.stats.misses += 1
            self.stats.rejected += 1
            warnings.warn(f"compile cache entry {path} not used: {exc}; compiling cold "
                          f"(`kiln cache clear` removes bad entries)", KilnCacheWarning, stacklevel=2)
            return False
        self.stats.hits += 1
        return True

    def save(self, key: str) -> bool:
        """Save what this process compiled under `key`; True when the entry now holds it.

        Only a writer (rank 0) saves. Returns False when disabled, not the writer, or when torch has
        nothing to save (backends other than Inductor leave no artifacts). Artifacts of every
        compile in this process go into the entry. A failed write warns and leaves the old entry.
        """
        if not self.enabled or not self.is_writer:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        payload, info = saved
        if not payload:
            return False
        path = self.entry_path(key)
        artifacts = dict(getattr(info, "artifacts", None) or {})
        self._note_artifacts(artifacts)
        payload_digest = hashlib.sha256(payload).hexdigest()
        # A warm run re-records what it loaded, in another order (torch 2.13), so the payload bytes
        # differ while the artifacts are the same: compare the artifacts' cache keys, not the bytes.
        contents = _artifacts_digest(artifacts) if artifacts else payload_digest
        if _existing_artifacts_digest(path) == contents:
            return True
        header = {
            "format": FORMAT_VERSION, "key": key, "torch": torch.__version__, "triton": triton_version(),
            "python": platform.python_version(), "created": time.time(),
            "description": self._descriptions.get(key, ""),
            "artifacts": {kind: len(keys) for kind, keys in artifacts.items()}, "artifacts_sha256": contents,
        }
        try:
            write_atomically(path, pack_envelope(MAGIC, header, payload))
        except OSError as exc:
            warnings.warn(f"compile cache entry {path} not written: {exc}", KilnCacheWarning, stacklevel=2)
            return False
        self.stats.saves += 1
        return True

    def _note_artifacts(self, artifacts: dict[str, list[str]] | None) -> None:
        for kind, keys in (artifacts or {}).items():
            self.artifact_keys.setdefault(str(kind), set()).update(str(k) for k in keys)

    # ----- compile records: what the last compile of a job took, for the live line's estimate ----
    def read_record(self, key: str) -> dict[str, Any] | None:
        """The record `write_record` saved under `key`, or None (none yet, disabled, unreadable:
        only an estimate rides on it, so an unreadable one is left for the next save to replace)."""
        if not self.enabled:
            return None
        try:
            record = json.loads(self._record_path(key).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return record if isinstance(record, dict) else None

    def write_record(self, key: str, record: dict[str, Any]) -> bool:
        """Save a small JSON record (what the compile of `key` did) beside the entry; writer only.
        Kept apart from the entry file, which exists only where torch saved artifacts (Inductor)."""
        if not self.enabled or not self.is_writer:
            return False
        path = self._record_path(key)
        try:
            write_atomically(path, canonical_json(record).encode())
        except OSError as exc:
            warnings.warn(f"compile record {path} not written: {exc}", KilnCacheWarning, stacklevel=2)
            return False
        return True

    def _record_path(self, key: str) -> Path:
        return self.progress_dir / (self.entry_path(key).stem + ".json")

    # ----- housekeeping (`kiln cache ls`, `kiln cache clear`) ------------------------------
    def entries(self) -> list[CacheEntryInfo]:
        """Every entry file, newest first; unreadable ones are listed with their problem."""
        found = []
        for path in self._entry_files():
            try:
                size = path.stat().st_size
            except OSError:
                continue  # removed while listing
            try:
                header, _ = read_entry(path)
            except (CorruptEntryError, OSError) as exc:
                found.append(CacheEntryInfo(path, size, None, "", None, problem=str(exc)))
                continue
            found.append(CacheEntryInfo(path, size, header.get("created"), header.get("description", ""),
                                        header.get("torch"), header.get("key")))
        return sorted(found, key=lambda e: (e.created is None, -(e.created or 0), e.file.name))

    def clear(self) -> int:
        """Remove Kiln's entries, stale temporary files, precompiled artifacts and Kiln's Inductor
        folder; return the number of entries removed. A user-chosen TORCHINDUCTOR_CACHE_DIR is never
        touched."""
        removed = 0
        for path in self._entry_files():
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
        for path in self.directory.glob(TEMP_PREFIX + "*") if self.directory.is_dir() else ():
            path.unlink(missing_ok=True)
        shutil.rmtree(self.inductor_dir, ignore_errors=True)
        shutil.rmtree(self.precompiled_dir, ignore_errors=True)
        shutil.rmtree(self.progress_dir, ignore_errors=True)
        shutil.rmtree(self.manifest_dir, ignore_errors=True)
        shutil.rmtree(self.quarantine_dir, ignore_errors=True)
        return removed

    def _entry_files(self) -> Iterator[Path]:
        if not self.directory.is_dir():
            return iter(())
        return (p for p in self.directory.iterdir() if p.suffix == ENTRY_SUFFIX and p.is_file())


# ---------------------------------------------------------------- entry files

def read_entry(path: Path) -> tuple[dict[str, Any], bytes]:
    """The header and payload of one entry file; CorruptEntryError says what is wrong with it."""
    return read_envelope(Path(path).read_bytes(), MAGIC, FORMAT_VERSION, "Kiln compile cache entry",
                         ("key", "torch"))


def pack_envelope(magic: bytes, header: dict[str, Any], payload: bytes) -> bytes:
    """The bytes of a checked file: the magic line, one JSON header line, the payload. The header
    gets the payload's size and checksum, which `read_envelope` verifies."""
    header = {**header, "payload_sha256": hashlib.sha256(payload).hexdigest(), "payload_bytes": len(payload)}
    return magic + canonical_json(header).encode() + b"\n" + payload


def read_envelope(data: bytes, magic: bytes, format_version: int, what: str,
                  required: tuple[str, ...] = ()) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of bytes made by `pack_envelope`; CorruptEntryError says what is wrong."""
    if not data.startswith(magic):
        raise CorruptEntryError(f"it is not a {what} (bad magic line)")
    end = data.find(b"\n", len(magic), len(magic) + MAX_HEADER_BYTES)
    if end < 0:
        raise CorruptEntryError("its header line is missing or cut off (truncated file?)")
    try:
        header = json.loads(data[len(magic):end])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptEntryError(f"its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptEntryError("its header is not a JSON object")
    if header.get("format") != format_version:
        raise CorruptEntryError(f"it has format {header.get('format')!r}; this Kiln reads format {format_version}")
    missing = [k for k in (*required, "payload_sha256", "payload_bytes") if k not in header]
    if missing:
        raise CorruptEntryError(f"its header lacks {', '.join(missing)}")
    payload = data[end + 1:]
    if len(payload) != header["payload_bytes"]:
        raise CorruptEntryError(f"its payload is {len(payload)} bytes, the header says "
                                f"{header['payload_bytes']} (truncated or appended to)")
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise CorruptEntryError("its payload does not match the checksum in its header (corrupted bytes)")
    return header, payload


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the complete new one, never a part.

    A temporary file in the same folder (same filesystem, so the rename is atomic) is written,
    flushed and fsynced, then renamed over `path`. On any error the temporary file is removed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    # os.open with 0o666 honours the umask, as a plain open() would (mkstemp would force 0600).
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable on POSIX; not possible (nor needed) on Windows.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _artifacts_digest(artifacts: dict[str, list[str]]) -> str:
    """A digest over the artifacts' cache keys, whatever order torch serialized them in."""
    lines = sorted(f"{kind}:{key}" for kind, keys in artifacts.items() for key in keys)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _existing_artifacts_digest(path: Path) -> str | None:
    try:
        header, _ = read_entry(path)
    except (CorruptEntryError, OSError):
        return None
    return header.get("artifacts_sha256")


def _set_by_kiln_or_torch(value: str, ours: Path) -> bool:
    """True when TORCHINDUCTOR_CACHE_DIR holds Kiln's folder or torch's default, not a user choice.

    torch writes its default folder back into the environment on first use (cache_dir_utils.
    cache_dir, torch 2.13), so a process that compiled before `activate` holds that default.
    """
    value = os.path.abspath(value)
    if value in (str(ours), _kiln_inductor_dir):
        return True
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return False
    return value == os.path.abspath(default_cache_dir())
