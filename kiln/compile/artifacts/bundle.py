"""Compile artifacts that travel with a checkpoint: the files one job's warm start needs, packed into one
checked file with the key they are valid for, and installed into another machine's empty caches.

Depends on torch, kiln.compile.isa_probe, kiln.compile.artifacts.cache and cache_key only; never on
kiln.checkpoint (which reaches this through CompileSession), the facade or a strategy.

What is packed (names inside the bundle, relative to the folder they are installed into):
    kiln/<key>.kiln                 Kiln's cache entries of the job's models (FX graph and AOTAutograd
                                    entries; on a GPU also the Triton kernels, bundled by Inductor)
    kiln/precompiled/<region>/...   the job's precompiled regions (.kpc artifacts, .jit notes)
    inductor/<xx>/...               on a CPU, the C++ kernels this process loaded, built (.so, .o) and
                                    their sources, and the CPU probe's check libraries: without them
                                    gcc runs again (DESIGN.md section 3)
Layout of the file: cache.pack_envelope's (magic line, one JSON header line, payload), the payload a
gzip'd tar of the files above. The header holds the job keys, the machine they were built on and, when
the writer holds a signing key, the key's id and an HMAC-SHA256 over header and payload (trust.py):
a checkpoint's bundle is installed only when the job's main process vouches for it (`vouch_for`).
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from kiln.compile import isa_probe
from kiln.compile.artifacts.cache import CompileCache, CorruptEntryError, pack_envelope, read_envelope, write_atomically
from kiln.compile.artifacts.cache_key import device_name, triton_version
from kiln.compile.artifacts.trust import key_id, signature, signature_problem, untrusted_message

MAGIC = b"KILN-COMPILE-ARTIFACTS\n"
FORMAT_VERSION = 1
KILN_PREFIX = "kiln/"
INDUCTOR_PREFIX = "inductor/"
# Files of a region folder that are someone's work in progress or private to a compile, never needed to load.
SKIPPED_SUFFIXES = (".lock", ".tmp")
SKIPPED_PARTS = (".aotautograd",)
# Header fields the envelope and the signature add (`seal`).
ENVELOPE_FIELDS = ("payload_sha256", "payload_bytes", "signed_by", "signature")
PROBE_SOURCE_MAX_BYTES = 4096  # Inductor's CPU probe sources are 150-460 bytes (torch 2.13)


@dataclass
class InstallResult:
    """What `install_bundle` did: `installed` files written, `present` files already there; `message` is
    set when nothing was installed for a reason the user is told (another machine, a damaged file)."""

    installed: int = 0
    present: int = 0
    message: str | None = None
    untrusted: bool = False  # nothing installed because nobody vouched for the bytes (trust.py)


@dataclass(frozen=True)
class Vouch:
    """The job's main process's verdict on a checkpoint's bundle: the sha256 of the file's bytes it checked
    and vouches for, or (`sha256` None) the message saying why it does not."""

    sha256: str | None
    problem: str | None = None
    untrusted: bool = False  # the problem is who wrote it (no valid signature), not a damaged file


def machine_key(device: torch.device | str) -> dict[str, str]:
    """What decides whether compiled code runs here: versions, CPU architecture and vector
    instructions, or the GPU and its compute capability. Two machines that differ here never share
    artifacts."""
    device = torch.device(device)
    key = {"torch": torch.__version__, "triton": triton_version(),
           "python": f"{platform.python_implementation()} {platform.python_version()}",
           "machine": platform.machine(), "device_type": device.type, "device": device_name(device)}
    if device.type == "cpu":
        key["isa"] = cpu_vector_isa()
    return key


def machine_differences(there: dict[str, str], here: dict[str, str]) -> list[str]:
    """What differs between two machine keys (`machine_key`), one "name 'a' there, 'b' here" each."""
    return [f"{name} {there.get(name)!r} there, {value!r} here" for name, value in here.items()
            if there.get(name) != value]


def cpu_vector_isa() -> str:
    """The widest vector instruction set the CPU reports (what Inductor's C++ kernels are built for),
    read from /proc/cpuinfo without running Inductor's probe (which builds code, isa_probe.py)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    for name in ("amx_tile", "avx512_vnni", "avx512bw", "avx512f", "avx2", "sve", "asimd", "neon"):
        if name in flags:
            return name
    return platform.machine()


def job_files(cache: CompileCache, keys: Iterable[str], region_folders: Iterable[Path]) -> dict[str, Path]:
    """The files of one job's warm start, by their name in the bundle."""
    files: dict[str, Path] = {}
    for key in keys:
        entry = cache.entry_path(key)
        if entry.is_file():
            files[KILN_PREFIX + entry.name] = entry
    for folder in region_folders:
        if not Path(folder).is_relative_to(cache.directory):
            continue  # a folder the caller chose outside Kiln's: not this cache's to carry
        files.update(named_files(files_under(Path(folder)), cache.directory, KILN_PREFIX))
    inductor = cache.inductor_dir_in_use
    for folder in loaded_kernel_folders(inductor):
        files.update(named_files(files_under(folder), inductor, INDUCTOR_PREFIX))
    files.update(named_files(cpu_probe_builds(inductor), inductor, INDUCTOR_PREFIX))
    return files


def named_files(paths: Iterable[Path], root: Path, prefix: str) -> dict[str, Path]:
    """`paths` (under `root`) by their names in a bundle: `prefix` and the path relative to `root`."""
    return {prefix + path.relative_to(root).as_posix(): path for path in paths}


def loaded_kernel_folders(inductor_dir: Path) -> set[Path]:
    """The folders of the C++ kernels Inductor loaded in this process (built here or found on disk).

    Inductor keys each kernel by a hash of its source and build command and keeps it at
    `<cache dir>/<key[1:3]>/<key>.*` beside the other files of its build (codecache.get_path and
    CppCodeCache.load_async, torch 2.13); `CppCodeCache.cache` and its subclasses' hold the keys of the
    kernels loaded. The whole folder is taken: a build's objects sit in its main source's folder.
    """
    try:
        from torch._inductor.codecache import CppCodeCache
    except ImportError:
        return set()
    folders = set()
    classes = [CppCodeCache]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        for key in list(getattr(cls, "cache", None) or ()):
            folder = inductor_dir / str(key)[1:3]
            if len(str(key)) > 3 and folder.is_dir():
                folders.add(folder)
    return folders


def cpu_probe_builds(inductor_dir: Path) -> list[Path]:
    """The libraries Inductor's CPU vector-instruction probe built (isa_probe.py), with their sources.

    A fresh process's first CPU compile or load asks which instruction sets this CPU and gcc
    support; for each it builds a tiny check library, `<key[1:3]>/<key>.cpp` and `.so` (torch 2.13;
    kernels are `<key>.main.cpp`), unless the library is there. They are not in CppCodeCache's
    caches, and without them a fresh machine's warm start runs gcc about 8 times (5 s of a 7.5 s
    resume on this project's CPU). Recognised by that name and a source of a few hundred bytes.
    With each library, Kiln's record of a load that succeeded (`<library>.kiln-load`, isa_probe.py)
    where there is one: a machine whose libraries, interpreter and CPU match its fingerprint (one
    image on identical hosts) then skips the load's new process too; any other asks again.
    """
    if not inductor_dir.is_dir():
        return []
    # Kiln's probe threads may still be building (gcc writes its library in place): taken mid-write,
    # a library's digest in the manifest or its bytes in a bundle would be a fragment's.
    isa_probe.wait()
    builds = []
    for source in inductor_dir.glob("*/c*.cpp"):
        library = source.with_suffix(".so")
        if source.name.endswith(".main.cpp") or not library.is_file():
            continue
        try:
            if source.stat().st_size > PROBE_SOURCE_MAX_BYTES:
                continue
        except OSError:
            continue
        builds.extend((source, library))
        record = library.with_name(library.name + isa_probe.RECORD_SUFFIX)
        if record.is_file():
            builds.append(record)
    return sorted(builds)


def write_bundle(path: Path, files: dict[str, Path], keys: list[str], device: torch.device | str,
                 signing_key: bytes | None = None) -> int:
    """Pack `files` (name in the bundle -> file) into `path` with the job keys and this machine's key,
    signed with `signing_key` when given; the bundle's size in bytes."""
    data = pack_bundle(files, keys, device, signing_key)
    write_atomically(path, data)
    return len(data)


def pack_bundle(files: dict[str, Path], keys: list[str], device: torch.device | str,
                signing_key: bytes | None = None) -> bytes:
    """A bundle's bytes (what `write_bundle` writes; sharing.py sends them, unsigned, to the job's other
    machines over its process group)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for name, source in sorted(files.items()):
            data = source.read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    header = {"format": FORMAT_VERSION, "keys": sorted(set(keys)), "machine": machine_key(device),
              "files": len(files)}
    return seal(header, buffer.getvalue(), signing_key)


def seal(header: dict[str, Any], payload: bytes, signing_key: bytes | None) -> bytes:
    """A bundle file's bytes from its header and payload: the envelope's checksum, and the signature
    under `signing_key` when given (a header's old checksum and signature are dropped first)."""
    header = {k: v for k, v in header.items() if k not in ENVELOPE_FIELDS}
    if signing_key is not None:  # the signature covers the header as pack_envelope completes it
        header.update(payload_sha256=hashlib.sha256(payload).hexdigest(), payload_bytes=len(payload),
                      signed_by=key_id(signing_key))
        header["signature"] = signature(signing_key, header, payload)
    return pack_envelope(MAGIC, header, payload)


def vouch_for(path: Path, signing_key: bytes | None, trust_all: bool = False) -> Vouch:
    """Whether the job may install the bundle at `path`: its signature is valid under `signing_key`, or
    the user said to trust it (`trust_all`). Called by the job's main process only; never raises."""
    try:
        data = path.read_bytes()
        header, payload = read_envelope(data, MAGIC, FORMAT_VERSION, "Kiln compile-artifacts bundle",
                                        ("keys", "machine"))
    except (CorruptEntryError, OSError) as exc:
        return Vouch(None, unreadable_message(path, exc))
    problem = None if trust_all else signature_problem(header, payload, signing_key)
    if problem is not None:
        return Vouch(None, untrusted_message(str(path), problem), untrusted=True)
    return Vouch(hashlib.sha256(data).hexdigest())


def install_bundle(path: Path, cache: CompileCache, keys: list[str], device: torch.device | str,
                   vouched: Vouch) -> InstallResult:
    """Install a bundle's files into `cache`'s folders where they are missing, if the job's main process
    vouched for these very bytes (`vouch_for`) and it was built for this machine. Never raises for a bad
    bundle: an untrusted or damaged file, or another torch or machine, gives `message` and nothing
    installed.

    A bundle of another job key (when `keys` are known and none is the bundle's) is installed too:
    `load_state` checks the model's names and shapes before this, so it is this model compiled under
    other settings, another strategy, number of processes or precision. Each file is found only by
    its own key (torch's caches key graphs by their content and settings, a precompiled region by its
    block source and settings, an artifact checks its call signature), so what the two jobs share is
    reused and the rest compiles; the caller loads the bundle's Kiln entries (`bundle_keys`), and
    `message` says so."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return InstallResult(message=unreadable_message(path, exc))
    return install_packed(data, str(path), cache, keys, device, vouched)


def install_packed(data: bytes, path: str, cache: CompileCache, keys: list[str],
                   device: torch.device | str, vouched: Vouch | None) -> InstallResult:
    """`install_bundle` for a bundle's bytes; `path` names where they came from in messages. `vouched`
    None: the bytes came from the job's own processes (sharing.py), which need no signature."""
    if vouched is not None and vouched.sha256 is None:
        return InstallResult(message=vouched.problem, untrusted=vouched.untrusted)
    if vouched is not None and hashlib.sha256(data).hexdigest() != vouched.sha256:
        return InstallResult(message=untrusted_message(path, "it is not the file the job's main process checked "
                                                             "(it changed since, or this machine sees another "
                                                             "file under its name)"), untrusted=True)
    try:
        header, payload = read_envelope(data, MAGIC, FORMAT_VERSION,
                                        "Kiln compile-artifacts bundle", ("keys", "machine"))
        members = read_members(payload)
    except (CorruptEntryError, OSError, tarfile.TarError, EOFError, ValueError) as exc:
        return InstallResult(message=unreadable_message(path, exc))
    result = InstallResult()
    here = machine_key(device)
    differences = machine_differences(header["machine"], here)
    if differences:
        result.message = (f"compile artifacts {path} were built on another machine or torch ("
                          + "; ".join(differences) + "): not installed; the first step compiles cold")
        return result
    if keys and not set(keys) & set(header["keys"]):
        result.message = (f"compile artifacts {path} were built under another job key (this model under other "
                          "compile settings, another strategy, number of processes or precision): installed, so "
                          "what the two jobs compile alike is reused; the rest compiles cold")
    for name, data in members:
        target = destination(name, cache)
        if target.exists():
            result.present += 1
            continue
        try:
            write_atomically(target, data)  # a reader (another local process, Inductor) sees all of it or nothing
        except OSError as exc:  # a full or read-only disk: what is written is whole, the rest compiles
            result.message = (f"compile artifacts {path} installed only in part ({result.installed} files): {exc}; "
                              "the rest compiles cold")
            return result
        result.installed += 1
    return result


def bundle_keys(path: Path) -> list[str]:
    """The job keys a bundle's header names (its first two lines: magic, JSON header); [] when the
    file cannot be read as a bundle. Cheap: the payload is not read or checked."""
    try:
        with open(path, "rb") as handle:
            if handle.readline() != MAGIC:
                return []
            header = json.loads(handle.readline())
    except (OSError, ValueError):
        return []
    keys = header.get("keys") if isinstance(header, dict) else None
    if not isinstance(keys, list):
        return []
    return [key for key in keys if isinstance(key, str) and re.fullmatch(r"[0-9a-f]{16,128}", key)]


def read_members(payload: bytes) -> list[tuple[str, bytes]]:
    """(name, bytes) of every file in a bundle's tar; ValueError for a name that would land outside
    the caches (absolute, `..`, or not under kiln/ or inductor/) or an entry that is not a file."""
    members = []
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if (not member.isfile() or member.name.startswith("/") or ".." in parts
                    or not member.name.startswith((KILN_PREFIX, INDUCTOR_PREFIX)) or len(parts) < 2):
                raise ValueError(f"it holds {member.name!r}, which is not a cache file")
            handle = tar.extractfile(member)
            members.append((member.name, handle.read() if handle is not None else b""))
    return members


def unreadable_message(path: Path | str, exc: Exception) -> str:
    """The one message for a bundle that cannot be read (gone, truncated, not a bundle)."""
    return f"compile artifacts {path} not used: {exc}; the first step compiles cold"


def destination(name: str, cache: CompileCache) -> Path:
    """Where a file named as in a bundle lies in `cache`'s folders."""
    if name.startswith(INDUCTOR_PREFIX):
        return cache.inductor_dir_in_use / name[len(INDUCTOR_PREFIX):]
    return cache.directory / name[len(KILN_PREFIX):]


def files_under(folder: Path) -> list[Path]:
    """The files of a cache folder worth carrying (no locks, temporary or private files)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()
                  and not p.name.endswith(SKIPPED_SUFFIXES) and not p.name.startswith(".tmp-")
                  and not any(part in SKIPPED_PARTS for part in p.relative_to(folder).parts))
