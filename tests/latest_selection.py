"""Which tests `make test-latest` runs: those that the newest releases can change.

    python tests/latest_selection.py PINNED_FREEZE LATEST_FREEZE PATH...

The two files are `pip list --format freeze` of the pinned environment (.venv, which make test ran)
and of the lane's. Prints the test files under PATH... to run, one per line, and on stderr the
versions the lane resolved and what differs from the pinned ones:
- nothing, when every library below resolved to its pinned version: make test ran these tests on
  the same releases;
- the files that mention a library, when only libraries a few tests use differ (a new peft: the
  files that mention peft or LoRA);
- every file, when anything else differs (transformers, Accelerate, torch, numpy, ...).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# Every library the lane upgrades, and what it resolves beside them (requirements-latest.txt).
WATCHED = ("torch", "transformers", "kernels", "accelerate", "diffusers", "peft", "torchao", "deepspeed",
           "torchdata", "huggingface_hub", "safetensors", "numpy")
# Libraries only some tests reach: the words a test file that reaches them contains.
NARROW = {"peft": r"peft|lora", "diffusers": r"diffusers|unet", "torchao": r"torchao|fp8|float8",
          "deepspeed": r"deepspeed", "torchdata": r"torchdata|stateful"}


def versions(freeze: str) -> dict[str, str]:
    found = {}
    for line in freeze.splitlines():
        name, _, version = line.partition("==")
        if version:
            found[name.strip().lower().replace("-", "_")] = version.strip()
    return found


def files_under(paths: list[str]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        files.extend(sorted(path.rglob("test_*.py")) if path.is_dir() else [path])
    return files


def select(pinned: dict[str, str], latest: dict[str, str], paths: list[str]) -> tuple[list[str], list[str]]:
    """(the files to run, the differences as 'name pinned -> latest')."""
    changed = [name for name in WATCHED if pinned.get(name) != latest.get(name)]
    differences = [f"{name} {pinned.get(name)} -> {latest.get(name)}" for name in changed]
    if not changed:
        return [], differences
    files = files_under(paths)
    if any(name not in NARROW for name in changed):
        return [str(f) for f in files], differences
    pattern = re.compile("|".join(NARROW[name] for name in changed), re.IGNORECASE)
    return [str(f) for f in files if pattern.search(f.read_text())], differences


def main(argv: list[str]) -> int:
    pinned, latest = (versions(Path(p).read_text()) for p in argv[:2])
    files, differences = select(pinned, latest, argv[2:])
    print("test-latest resolved: " + ", ".join(f"{name}=={latest.get(name)}" for name in WATCHED), file=sys.stderr)
    print("newest releases against the pinned ones: " + ("; ".join(differences) or "all the same"), file=sys.stderr)
    print("\n".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
