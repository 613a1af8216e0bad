"""`kiln cache ls`, `kiln cache clear` and `kiln cache key`: look at and empty the warm-start compile cache,
and print the key that signs its compiled code in checkpoints.

Depends on kiln.compile.artifacts.cache and trust only; never on the facade.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from kiln.compile.artifacts.cache import ENV_DIR, ENV_ENABLED, INDUCTOR_ENV, CacheEntryInfo, CompileCache
from kiln.compile.artifacts.trust import ENV_KEY, KEY_FILE, key_id, signing_key


def add_parser(commands: Any) -> None:
    """Register `cache` and its actions on the top-level subparsers."""
    parser = commands.add_parser("cache", help="list or clear the warm-start compile cache",
                                 description="The compile cache that lets a second run skip the cold compile.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, run, help_text in (("ls", run_ls, "list entries, sizes, ages and descriptions"),
                                 ("clear", run_clear, "remove every entry and Kiln's Inductor folder"),
                                 ("key", run_key, f"print the key that signs checkpoints' compiled code (made if "
                                                  f"missing), to give other machines as {ENV_KEY}")):
        action = actions.add_parser(name, help=help_text, description=help_text)
        action.add_argument("--dir", type=Path, default=None,
                            help=f"cache folder (default: ${ENV_DIR}, else ~/.cache/kiln/compile)")
        action.set_defaults(run=run)


def open_cache(args: argparse.Namespace) -> CompileCache:
    try:
        return CompileCache(directory=args.dir)
    except ValueError as exc:  # a bad KILN_COMPILE_CACHE value
        raise SystemExit(f"kiln cache: {exc}") from None


def run_ls(args: argparse.Namespace) -> int:
    cache = open_cache(args)
    print(ls_text(cache, source=_source(args)))
    return 0


def run_clear(args: argparse.Namespace) -> int:
    cache = open_cache(args)
    entries_bytes = sum(e.size for e in cache.entries())
    inductor_bytes = folder_size(cache.inductor_dir)
    had_inductor = cache.inductor_dir.is_dir()
    removed = cache.clear()
    if not removed and not had_inductor:
        print(f"nothing to remove in {cache.directory}")
        return 0
    print(f"removed {removed} {_plural(removed, 'entry', 'entries')} ({human_size(entries_bytes)}) "
          f"from {cache.directory}")
    if had_inductor:
        print(f"removed Kiln's Inductor folder {cache.inductor_dir} ({human_size(inductor_bytes)})")
    return 0


def run_key(args: argparse.Namespace) -> int:
    """The signing key on stdout alone (for `export KILN_COMPILE_SIGNING_KEY=$(kiln cache key)`), where it
    comes from on stderr."""
    cache = open_cache(args)
    try:
        key = signing_key(cache.directory, create=True)
    except ValueError as exc:  # a KILN_COMPILE_SIGNING_KEY too short to use
        raise SystemExit(f"kiln cache: {exc}") from None
    if key is None:
        raise SystemExit(f"kiln cache: the key file {cache.directory / KEY_FILE} is not private to you (see the "
                         "warning above); fix its permissions or set " + ENV_KEY)
    where = f"${ENV_KEY}" if os.environ.get(ENV_KEY) else str(cache.directory / KEY_FILE)
    print(key.decode())
    print(f"(from {where}; key id {key_id(key)}. Give it to the machines that resume this job's checkpoints as "
          f"{ENV_KEY}, like any other secret.)", file=sys.stderr)
    return 0


def ls_text(cache: CompileCache, source: str = "", now: float | None = None) -> str:
    """The readable listing `kiln cache ls` prints."""
    now = time.time() if now is None else now
    entries = cache.entries()
    entries_bytes = sum(e.size for e in entries)
    inductor_bytes = folder_size(cache.inductor_dir)
    state = "enabled" if cache.enabled else f"disabled by {ENV_ENABLED}={os.environ.get(ENV_ENABLED)}"
    lines = [
        f"cache folder:    {cache.directory} ({state}{'; ' + source if source else ''})",
        f"entries:         {len(entries)}, {human_size(entries_bytes)}",
        f"inductor folder: {cache.inductor_dir}, {human_size(inductor_bytes)}",
        f"total on disk:   {human_size(folder_size(cache.directory))}",
    ]
    user_dir = os.environ.get(INDUCTOR_ENV)
    if user_dir and Path(user_dir).absolute() != cache.inductor_dir:
        lines.append(f"note: {INDUCTOR_ENV}={user_dir} is set, so Inductor caches there instead "
                     "(and `kiln cache clear` leaves it alone)")
    lines.append("")
    if not entries:
        lines.append("no entries yet: the first compiled run of a job saves one")
        return "\n".join(lines)
    lines.append(entries_table(entries, now))
    return "\n".join(lines)


def entries_table(entries: list[CacheEntryInfo], now: float) -> str:
    header = ("entry", "size", "age", "torch", "description")
    rows = [header]
    for e in entries:
        name = e.file.name if len(e.file.name) <= 20 else e.file.stem[:16] + "..."  # a key prefix
        age = human_age(now - e.created) if e.created is not None else "?"
        description = f"CORRUPT: {e.problem}" if e.corrupt else e.description
        rows.append((name, human_size(e.size), age, e.torch_version or "?", description))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for row in rows:
        cells = [row[i].rjust(w) if i == 1 else row[i].ljust(w) for i, w in enumerate(widths)]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(lines)


def folder_size(folder: Path) -> int:
    """Bytes in the files under `folder` (0 when it does not exist); links are not followed."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # not reached


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _source(args: argparse.Namespace) -> str:
    if args.dir is not None:
        return "--dir"
    return f"from ${ENV_DIR}" if os.environ.get(ENV_DIR) else "the default"


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many
