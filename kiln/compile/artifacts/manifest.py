"""What one job's compiled code is made of in the Inductor folder, file by file with its digest, so that a
damaged or replaced file is moved aside before torch loads it, and compiled again.

Depends on kiln.compile.artifacts.cache (folders, atomic writes) and bundle (which files a job's warm start
needs) only; never on the session, the facade or a strategy.

Why before, not after: torch loads a kernel library or a generated module from the path its key names, as
it is found (torch 2.13: CppCodeCache builds a kernel only when its `.so` is missing, and a cache hit never
rewrites an existing output `.py`). A replaced library runs its constructor as it loads, a scrambled one
crashes the process inside dlopen, and a wrong module fails at its first call: nothing that fails later
can be caught in time. So each machine's local main process records the digests of the files it used
(`record`, at the end of warm-up and at save_state), and checks them as the next job starts (`check`),
before anything compiles or loads. A file whose bytes differ is moved into
`<Kiln folder>/quarantine/`, and torch, finding nothing there, builds it again. Kiln's own `.kiln` and
`.kpc` files carry checksums of their own and are checked where they are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable

from kiln.compile.artifacts import bundle
from kiln.compile.artifacts.cache import CompileCache, write_atomically
from kiln.compile.artifacts.cache_key import canonical_json

# Where Inductor keeps a cache entry of each kind, by its key (FxGraphCache._get_tmp_dir_for_key and
# AOTAutogradCache._get_tmp_dir_for_key, torch 2.13); the keys are torch.compiler's artifact keys.
ENTRY_FOLDERS = {"inductor": lambda key: f"fxgraph/{key[1:3]}/{key}", "aot_autograd": lambda key: f"aotautograd/{key}"}
FORMAT_VERSION = 1


def job_inductor_files(cache: CompileCache, keys: Iterable[str]) -> dict[str, Path]:
    """The Inductor files this process's compiled code came from, by their names in a bundle: the C++
    kernels it loaded with their builds and sources, the CPU probe's builds, the generated Python
    modules (output code, and on a GPU the Triton kernels' sources) it imported, and the FX-graph and
    AOTAutograd cache entries it saved or loaded."""
    files = {name: path for name, path in bundle.job_files(cache, keys, []).items()
             if name.startswith(bundle.INDUCTOR_PREFIX)}
    inductor = cache.inductor_dir_in_use
    files.update(bundle.named_files(loaded_modules(inductor), inductor, bundle.INDUCTOR_PREFIX))
    for kind, folder_of in ENTRY_FOLDERS.items():
        for key in sorted(cache.artifact_keys.get(kind, ())):
            files.update(bundle.named_files(bundle.files_under(inductor / folder_of(key)), inductor,
                                            bundle.INDUCTOR_PREFIX))
    return files


def loaded_modules(inductor_dir: Path) -> list[Path]:
    """The generated modules under `inductor_dir` that Inductor imported in this process
    (PyCodeCache.modules, torch 2.13)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None:
        return []
    paths = set()
    for module in list(getattr(codecache.PyCodeCache, "modules", ())):
        file = getattr(module, "__file__", None)
        if file and Path(file).is_relative_to(inductor_dir) and Path(file).is_file():
            paths.add(Path(file))
    return sorted(paths)


def record(cache: CompileCache, keys: Iterable[str]) -> int:
    """Write each job key's manifest: the digests of `job_inductor_files`, added to what an earlier run
    of the job recorded for files still there. The number of files recorded."""
    keys = list(keys)
    digests = {name: file_digest(path) for name, path in job_inductor_files(cache, keys).items()}
    digests = {name: digest for name, digest in digests.items() if digest is not None}
    written = 0
    for key in keys:
        previous = _read(cache, key)
        merged = {name: digest for name, digest in previous.items() if bundle.destination(name, cache).is_file()}
        merged.update(digests)
        if merged and merged != previous:
            write_atomically(_path(cache, key), canonical_json({"format": FORMAT_VERSION, "key": key,
                                                                "files": merged}).encode())
        written = max(written, len(merged))
    return written


def check(cache: CompileCache, key: str) -> list[str]:
    """Move aside every file the job's manifest records whose bytes differ now; the names moved. A file
    that is gone is left to torch to build again; one that cannot be read is moved aside too."""
    moved = []
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for name, digest in _read(cache, key).items():
        path = bundle.destination(name, cache)
        if not path.exists():
            continue
        if file_digest(path) == digest:
            continue
        if quarantine(path, cache.quarantine_dir / stamp / name):
            moved.append(name)
    return moved


def quarantine(path: Path, target: Path) -> bool:
    """Move `path` to `target` (kept for a look), else rename it beside itself (another filesystem), else
    remove it: whatever happens, torch no longer finds it. False when another process moved it first."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.replace(path, path.with_name(path.name + ".damaged"))
        return True
    except FileNotFoundError:
        return False
    except OSError:
        path.unlink(missing_ok=True)
        return True


def file_digest(path: Path) -> str | None:
    """sha256 of a file's bytes; None when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _path(cache: CompileCache, key: str) -> Path:
    return cache.manifest_dir / f"{cache.entry_path(key).stem}.json"


def _read(cache: CompileCache, key: str) -> dict[str, str]:
    """A key's recorded files; {} when there is no manifest or it cannot be read (nothing to check)."""
    try:
        content = json.loads(_path(cache, key).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    files = content.get("files") if isinstance(content, dict) else None
    if not isinstance(files, dict):
        return {}
    return {name: digest for name, digest in files.items()
            if isinstance(name, str) and isinstance(digest, str) and name.startswith(bundle.INDUCTOR_PREFIX)
            and ".." not in Path(name).parts}
