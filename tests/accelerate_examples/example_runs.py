"""Runs Accelerate's own example scripts in fresh processes: as they are, with the real Accelerate,
and with only their import lines changed to Kiln's, on 1 or 2 processes, two runs at a time.

Must not depend on Kiln: it starts the scripts, it never imports what they use.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent / "upstream"
ROOT = Path(__file__).resolve().parents[2]
STANDIN_NAMES = ("bert-base-cased", "HuggingFaceTB", "nyu-mll", "Salesforce", "glue", "NousResearch", "roneneldan")

# `from accelerate import X`, `from accelerate.utils import Y`, `from accelerate.local_sgd import Z`,
# `import accelerate`: the module path is all that changes.
IMPORT_LINE = re.compile(r"^(?P<indent>\s*)(?P<verb>from|import) accelerate(?P<rest>(\.[\w.]+)?( |$).*)$")

# Accelerate shuffles with a seed drawn from the global RNG at each epoch unless
# `use_seedable_sampler=True` (then seed + epoch, Kiln's order). This runs a script unchanged with
# that option on, so that a 1-process Kiln run can be held to the same numbers.
SEEDABLE_RUNNER = (
    "import runpy, sys, accelerate; "
    "accelerate.Accelerator.use_seedable_sampler = property(lambda self: True); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def rewrite_imports(source: str) -> str:
    """The script with each `accelerate` import line importing from `kiln` instead."""
    lines = []
    for line in source.splitlines(keepends=True):
        match = IMPORT_LINE.match(line.rstrip("\n"))
        if match:
            line = f"{match['indent']}{match['verb']} kiln{match['rest']}" + ("\n" if line.endswith("\n") else "")
        lines.append(line)
    return "".join(lines)


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    """(old, new) for each line the rewrite replaced; raises if it added or removed lines."""
    old, new = before.splitlines(), after.splitlines()
    pairs = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag != "replace" or i2 - i1 != j2 - j1:
            raise AssertionError(f"the rewrite {tag}d lines {i1 + 1}-{i2}: {old[i1:i2]} -> {new[j1:j2]}")
        pairs.extend(zip(old[i1:i2], new[j1:j2]))
    return pairs


def kiln_copy(script: str, folder: Path) -> Path:
    """The upstream script with its imports rewritten, at the same relative path under `folder`."""
    target = folder / script
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rewrite_imports((UPSTREAM / script).read_text()))
    return target


class Run:
    """One launch of one script in a working folder of its own (the stand-ins linked into it).

    flavor: "accelerate" (the script as it is), "accelerate-seedable" (as it is, Accelerate's
    seedable sampler on), or "kiln" (imports rewritten); processes: 1, or 2 on gloo through
    torch.distributed.run; env: added to the environment (e.g. Kiln's compile settings)."""

    def __init__(self, name: str, script: str, args: list[str], flavor: str, work: Path, standins: Path,
                 kiln_scripts: Path, processes: int = 1, env: dict[str, str] | None = None):
        self.name, self.script, self.args, self.flavor = name, script, list(args), flavor
        self.work, self.standins, self.kiln_scripts = work, standins, kiln_scripts
        self.processes, self.env = processes, dict(env or {})
        self.process = None
        self.stdout = self.stderr = ""
        self.returncode: int | None = None
        self.seconds = 0.0

    def command(self) -> list[str]:
        if self.flavor == "kiln":
            path = kiln_copy(self.script, self.kiln_scripts)
        else:
            path = UPSTREAM / self.script
        if self.processes > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={self.processes}", str(path), "--cpu", *self.args]
        if self.flavor == "accelerate-seedable":
            return [sys.executable, "-c", SEEDABLE_RUNNER, str(path), "--cpu", *self.args]
        return [sys.executable, str(path), "--cpu", *self.args]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "ACCELERATE_"))}
        # Caches of this run's own: datasets' and evaluate's, and Kiln's warm-start folder.
        env.update(
            PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HOME=str(self.work / "hf-home"),
            KILN_COMPILE_CACHE_DIR=str(self.work / "kiln-cache"), HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1",
            WANDB_MODE="offline", WANDB_DIR=str(self.work), WANDB_SILENT="true",
            MLFLOW_TRACKING_URI=f"sqlite:///{self.work / 'mlflow.db'}", PYTHONHASHSEED="0",
            **self.env,
        )
        return env

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        for name in STANDIN_NAMES:
            link = self.work / name
            if not link.exists():
                link.symlink_to(self.standins / name, target_is_directory=True)
        self.started = time.monotonic()
        # Files, not pipes: a script that prints more than a pipe holds would wait for a reader.
        with open(self.work / "stdout.txt", "w") as out, open(self.work / "stderr.txt", "w") as err:
            self.process = subprocess.Popen(self.command(), cwd=self.work, env=self.environment(),
                                            stdout=out, stderr=err)

    def finish(self) -> None:
        self.returncode = self.process.wait(timeout=600)
        self.seconds = time.monotonic() - self.started
        self.stdout = (self.work / "stdout.txt").read_text(errors="replace")
        self.stderr = (self.work / "stderr.txt").read_text(errors="replace")

    def failure(self) -> str | None:
        """None if the run exited 0, else what it printed last."""
        if self.returncode == 0:
            return None
        return (f"{self.name} ({self.flavor}, {self.processes} process(es), env {self.env}) exited "
                f"{self.returncode}\n--- stdout ---\n{self.stdout[-2000:]}\n--- stderr ---\n{self.stderr[-6000:]}")


def run_all(runs: list[Run], workers: int = 2) -> None:
    """Run them `workers` at a time, in order; a 2-process run counts as two workers."""
    pending, active = list(runs), []
    while pending or active:
        busy = sum(run.processes for run in active)
        if pending and (not active or busy + pending[0].processes <= workers):
            run = pending.pop(0)
            run.start()
            active.append(run)
            continue
        done = next((run for run in active if run.process.poll() is not None), None)
        if done is None:
            time.sleep(0.05)
            continue
        done.finish()
        active.remove(done)
