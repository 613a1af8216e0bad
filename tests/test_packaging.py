"""The distribution: `kiln-torch` builds into a wheel that holds the `kiln` package and its command,
declares its dependencies and extras, and runs when installed on its own (outside this checkout)."""

import email
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kiln

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # No build isolation: the pinned setuptools of the test environment builds it, with no download.
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = out.glob("*.whl")
    return path


def test_the_wheel_is_kiln_torch_with_every_module_and_the_command(wheel):
    assert wheel.name.startswith(f"kiln_torch-{kiln.__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"kiln_torch-{kiln.__version__}.dist-info"
        metadata = email.message_from_string(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kiln").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert not any(name.startswith(("tests/", "benchmarks/", "examples/")) for name in names)
    assert metadata["Name"] == "kiln-torch" and metadata["Version"] == kiln.__version__
    requires = metadata.get_all("Requires-Dist")
    assert "torch>=2.11" in requires  # a range (from the lowest torch CI tests), never the pinned build
    assert any(r.startswith("deepspeed") and 'extra == "deepspeed"' in r for r in requires)
    assert "kiln = kiln.cli:main" in entry_points


def test_the_installed_wheel_imports_and_runs_its_command_outside_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = subprocess.run([sys.executable, "-c", "import kiln, kiln.cli; print(kiln.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert Path(probe.stdout.strip()).is_relative_to(target)  # this wheel's kiln, not the checkout's
    command = subprocess.run([str(target / "bin" / "kiln"), "launch", "--help"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert command.returncode == 0 and "--max_restarts" in command.stdout, command.stderr[-2000:]
