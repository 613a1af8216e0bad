"""Tests for `kiln cache ls` and `kiln cache clear` (kiln/cli/cache.py) and the `kiln` entry point.

Caches live under tmp_path; entries are written through CompileCache with torch's artifact saver faked.
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import kiln.compile.artifacts.cache as cache_module
from kiln.cli import main
from kiln.compile.artifacts.cache import ENTRY_SUFFIX, INDUCTOR_ENV, CompileCache
from toy_models import EncoderDecoder, Flat


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    for name in (INDUCTOR_ENV, "KILN_COMPILE_CACHE", "KILN_COMPILE_CACHE_DIR"):
        monkeypatch.setenv(name, "placeholder")  # records the original value for the undo
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cache_module, "_kiln_inductor_dir", None)


@pytest.fixture
def filled_cache(tmp_path, monkeypatch):
    """A cache folder with two good entries, one corrupt file and an Inductor folder of 1000 bytes."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts",
                        lambda: (b"x" * 3000, SimpleNamespace(artifacts={"inductor": ["k"]})))
    folder = tmp_path / "cache"
    cache = CompileCache(folder)
    for model in (EncoderDecoder(), Flat()):
        assert cache.save(cache.key(model, {"backend": "inductor", "precision": "bf16"}, torch.device("cpu")))
    (folder / ("0" * 64 + ENTRY_SUFFIX)).write_bytes(b"garbage")
    (folder / "inductor" / "fxgraph").mkdir(parents=True)
    (folder / "inductor" / "fxgraph" / "graph").write_bytes(b"g" * 1000)
    return folder


def test_cache_ls_on_empty_folder_says_there_are_no_entries(tmp_path, capsys):
    assert main(["cache", "ls", "--dir", str(tmp_path / "empty")]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "empty") in out and "entries:         0, 0 B" in out
    assert "no entries yet" in out


def test_cache_ls_lists_entries_sizes_ages_and_descriptions(filled_cache, capsys):
    assert main(["cache", "ls", "--dir", str(filled_cache)]) == 0
    out = capsys.readouterr().out
    assert "entries:         3," in out
    assert f"inductor folder: {filled_cache / 'inductor'}, 1000 B" in out
    assert "EncoderDecoder (5.2K params), backend=inductor, mode=default, precision=bf16, cpu" in out
    assert "Flat (" in out and "CORRUPT: it is not a Kiln compile cache entry" in out
    assert " 0 s " in out and torch.__version__ in out
    header = next(line for line in out.splitlines() if line.startswith("entry"))
    assert header.split() == ["entry", "size", "age", "torch", "description"]


def test_cache_ls_reads_folder_from_environment_and_notes_users_inductor_folder(filled_cache, capsys,
                                                                              monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_COMPILE_CACHE_DIR", str(filled_cache))
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "mine"))
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert f"{filled_cache} (enabled; from $KILN_COMPILE_CACHE_DIR)" in out
    assert f"{INDUCTOR_ENV}={tmp_path / 'mine'} is set" in out


def test_cache_clear_removes_entries_and_says_what(filled_cache, capsys):
    assert main(["cache", "clear", "--dir", str(filled_cache)]) == 0
    out = capsys.readouterr().out
    assert "removed 3 entries" in out and "Inductor folder" in out and "1000 B" in out
    assert list(filled_cache.iterdir()) == []
    assert main(["cache", "clear", "--dir", str(filled_cache)]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_bad_kiln_compile_cache_value_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_COMPILE_CACHE", "maybe")
    with pytest.raises(SystemExit, match="KILN_COMPILE_CACHE='maybe'"):
        main(["cache", "ls", "--dir", str(tmp_path)])


@pytest.mark.parametrize("argv", [[], ["launchh"], ["cache"], ["cache", "rm"]])
def test_unknown_or_missing_subcommand_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: kiln" in capsys.readouterr().err


def test_python_dash_m_kiln_lists_the_cache(filled_cache, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_ENV}
    env.update(KILN_COMPILE_CACHE_DIR=str(filled_cache), HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-m", "kiln", "cache", "ls"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(filled_cache) in proc.stdout and "EncoderDecoder" in proc.stdout


def test_key_prints_the_folders_signing_key_made_owner_only_and_the_environments_first(tmp_path, monkeypatch, capsys):
    import stat

    from kiln.compile.artifacts.trust import ENV_KEY, KEY_FILE, key_id

    monkeypatch.delenv(ENV_KEY, raising=False)
    assert main(["cache", "key", "--dir", str(tmp_path / "cache")]) == 0
    out, err = capsys.readouterr()
    key_file = tmp_path / "cache" / KEY_FILE
    assert out == key_file.read_text() and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert f"key id {key_id(out.strip().encode())}" in err and str(key_file) in err
    assert main(["cache", "key", "--dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out == out  # made once

    monkeypatch.setenv(ENV_KEY, "t" * 40)
    assert main(["cache", "key", "--dir", str(tmp_path / "cache")]) == 0
    out, err = capsys.readouterr()
    assert out == "t" * 40 + "\n" and f"${ENV_KEY}" in err
    monkeypatch.setenv(ENV_KEY, "short")
    with pytest.raises(SystemExit, match="KILN_COMPILE_SIGNING_KEY holds 5 characters"):
        main(["cache", "key", "--dir", str(tmp_path / "cache")])
