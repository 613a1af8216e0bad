"""Whose compiled code Kiln runs: the signing key that vouches for a checkpoint's compile artifacts, and the
checks that keep a cache folder the user's own.

Depends on the standard library and kiln.compile.artifacts.cache_key only; never on the rest of Kiln.

Compiled code is code: an Inductor kernel is a shared library whose constructor runs when it is loaded,
and precompiled regions and torch's cache entries are read with pickle. Kiln loads such files only from
sources it can vouch for:
- its own cache folder, which must be the user's and writable by nobody else (as ssh treats ~/.ssh);
- the job's own processes (sharing.py sends artifacts over the job's process group);
- a checkpoint's bundle whose HMAC-SHA256 signature was made with a key this user holds: the key in
  KILN_COMPILE_SIGNING_KEY, else `signing.key` in the Kiln cache folder, created on first use with
  owner-only permissions. In a job of several processes the main process signs and checks, and tells the
  others the digest of what it checked (session.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import warnings
from pathlib import Path
from typing import Any

from kiln.compile.artifacts.cache_key import canonical_json

ENV_KEY = "KILN_COMPILE_SIGNING_KEY"
KEY_FILE = "signing.key"
MIN_KEY_CHARS = 32
TRUST_OPTION = "load_state(..., trust_compile_artifacts=True)"
MAKE_KEY = "python -c 'import secrets; print(secrets.token_hex(32))'"


class KilnTrustWarning(UserWarning):
    """Compiled code was not loaded because Kiln cannot vouch for where it came from."""


def signing_key(folder: Path | None, create: bool = False) -> bytes | None:
    """The key this user signs and checks bundles with: KILN_COMPILE_SIGNING_KEY, else the key file in
    the Kiln cache `folder` (made there when `create`, owner-only); None when there is none (no folder,
    no file), or the file is not private.
    A value of KILN_COMPILE_SIGNING_KEY shorter than 32 characters is a ValueError."""
    value = os.environ.get(ENV_KEY)
    if value is not None:
        if len(value.strip()) < MIN_KEY_CHARS:
            raise ValueError(f"{ENV_KEY} holds {len(value.strip())} characters; a signing key needs at least "
                             f"{MIN_KEY_CHARS} (make one with: {MAKE_KEY})")
        return value.strip().encode()
    if folder is None:
        return None
    path = Path(folder) / KEY_FILE
    if not path.is_file():
        if not create:
            return None
        _create_key_file(path)
    problem = _private_file_problem(path)
    if problem is not None:
        warnings.warn(f"signing key {path} not used: {problem}; compile artifacts are neither signed nor "
                      f"trusted with it (chmod 600 {path}, or set {ENV_KEY})", KilnTrustWarning, stacklevel=3)
        return None
    text = path.read_text().strip()
    return text.encode() if len(text) >= MIN_KEY_CHARS else None


def key_id(key: bytes) -> str:
    """A short name for a key that gives nothing of it away (shown in messages, stored in bundles)."""
    return hmac.new(key, b"kiln signing key id", hashlib.sha256).hexdigest()[:16]


def signature(key: bytes, header: dict[str, Any], payload: bytes) -> str:
    """HMAC-SHA256 over a bundle's header (less its `signature`) and payload."""
    mac = hmac.new(key, canonical_json({k: v for k, v in header.items() if k != "signature"}).encode(),
                   hashlib.sha256)
    mac.update(b"\n")
    mac.update(payload)
    return mac.hexdigest()


def signature_problem(header: dict[str, Any], payload: bytes, key: bytes | None) -> str | None:
    """Why a bundle's signature does not vouch for it under `key`, as the clause of a sentence; None
    when it does."""
    signed_by = header.get("signed_by")
    if not isinstance(header.get("signature"), str) or not isinstance(signed_by, str):
        return "it carries no signature, so nothing says who wrote the compiled code in it"
    if key is None:
        return (f"it was signed with key {signed_by}, and this machine holds no signing key "
                f"(a fresh machine: set {ENV_KEY} to the key of the job that wrote it)")
    if signed_by != key_id(key):
        return (f"it was signed with key {signed_by}, not with this job's key {key_id(key)} (set {ENV_KEY} to "
                "the key of the job that wrote it, the same value on every machine)")
    if not hmac.compare_digest(header["signature"], signature(key, header, payload)):
        return "its signature does not match its contents: it was changed after it was signed"
    return None


def untrusted_message(path: str, problem: str) -> str:
    """The one message for a bundle Kiln will not install: why, and the two ways to accept it."""
    return (f"compile artifacts {path} not installed: {problem}. Compiled code runs in this process, so Kiln "
            f"installs it only with a valid signature; the first step compiles cold. If you trust whoever wrote "
            f"this checkpoint to run code on this machine, pass {TRUST_OPTION}; to share compiled code across "
            f"machines or a team, give every job the same {ENV_KEY} (docs/checkpoints.md#trust)")


def make_private_folder(folder: Path) -> None:
    """Create `folder` (and its parents) if missing, the folder itself owner-only (0700), as ssh-keygen
    makes ~/.ssh; an existing folder is left as it is (`folder_problem` judges it)."""
    if not folder.exists():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.chmod(folder, 0o700)  # mkdir's mode passes through the umask; a race left it to another: same
        except OSError:
            pass


def folder_problem(folder: Path) -> str | None:
    """Why compiled code must not be loaded from `folder` (owned by another user, or writable by other
    users, who could plant a library there); None when it is safe or does not exist. No check on
    systems without POSIX owners."""
    if not hasattr(os, "getuid"):
        return None
    try:
        info = os.stat(folder)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"it cannot be examined ({exc})"
    if info.st_uid not in (os.getuid(), 0):
        return f"it belongs to another user (uid {info.st_uid}; this process runs as uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "every user" if info.st_mode & stat.S_IWOTH else "its group"
        return (f"{who} can write to it (mode {stat.S_IMODE(info.st_mode):04o}), so another user could put "
                "code there that this process would load")
    return None


def _private_file_problem(path: Path) -> str | None:
    if not hasattr(os, "getuid"):
        return None
    info = os.stat(path)
    if info.st_uid != os.getuid():
        return f"it belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o077:
        return f"other users can read or write it (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _create_key_file(path: Path) -> None:
    """Write a new random key, owner-only, atomically: of several local processes making one at once,
    the first link wins and the others read it."""
    make_private_folder(path.parent)
    temp = path.parent / f".tmp-{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
    finally:
        temp.unlink(missing_ok=True)
