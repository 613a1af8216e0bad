"""The record of a job's compiled files (kiln/compile/artifacts/manifest.py): what the main process records,
and what a later start moves aside before torch could load it. No real kernel is built here (tests of the
real thing, with Inductor, are in test_tampering.py)."""

import json
import types

import pytest

from kiln.compile.artifacts import manifest
from kiln.compile.artifacts.cache import INDUCTOR_ENV, CompileCache

KEY = "ab" * 32


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A Kiln folder whose Inductor folder holds one loaded kernel (source and build), one generated
    module and one FX-graph cache entry, as torch 2.13 lays them out."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache, PyCodeCache

    monkeypatch.delenv(INDUCTOR_ENV, raising=False)  # activate's setting is undone after the test
    cache = CompileCache(tmp_path / "kiln")
    cache.activate()
    inductor = cache.inductor_dir
    kernel = "ck7" + "a" * 49
    (inductor / "k7").mkdir()
    (inductor / "k7" / f"{kernel}.main.cpp").write_text("// kernel")
    (inductor / "k7" / f"{kernel}.main.so").write_bytes(b"\x7fELF built")
    (inductor / "zz").mkdir()
    (inductor / "zz" / "czzoutput.py").write_text("def call(args): return args\n")
    entry = inductor / "fxgraph" / "q4" / "fq4key"
    entry.mkdir(parents=True)
    (entry / "pickled").write_bytes(b"graph")
    monkeypatch.setitem(CppPythonBindingsCodeCache.cache, kernel, lambda: None)
    module = types.ModuleType("czzoutput")
    module.__file__ = str(inductor / "zz" / "czzoutput.py")
    monkeypatch.setattr(PyCodeCache, "modules", [module])
    cache.artifact_keys = {"inductor": {"fq4key"}}
    return cache


def test_the_record_holds_every_inductor_file_of_the_job_with_its_digest(cache):
    assert manifest.record(cache, [KEY]) == 4
    recorded = json.loads((cache.directory / "manifests" / f"{KEY}.json").read_text())["files"]
    assert sorted(recorded) == ["inductor/fxgraph/q4/fq4key/pickled", "inductor/k7/ck7" + "a" * 49 + ".main.cpp",
                                "inductor/k7/ck7" + "a" * 49 + ".main.so", "inductor/zz/czzoutput.py"]
    assert recorded["inductor/zz/czzoutput.py"] == manifest.file_digest(cache.inductor_dir / "zz" / "czzoutput.py")
    assert manifest.check(cache, KEY) == []  # nothing changed: nothing moved


def test_changed_files_are_moved_aside_and_the_rest_stay(cache):
    manifest.record(cache, [KEY])
    library = cache.inductor_dir / "k7" / ("ck7" + "a" * 49 + ".main.so")
    module = cache.inductor_dir / "zz" / "czzoutput.py"
    library.write_bytes(b"\x7fELF someone else's")
    module.write_text(module.read_text()[:5])  # truncated
    (cache.inductor_dir / "fxgraph" / "q4" / "fq4key" / "pickled").unlink()  # gone: torch builds it again
    moved = manifest.check(cache, KEY)
    assert sorted(moved) == [f"inductor/k7/{library.name}", "inductor/zz/czzoutput.py"]
    assert not library.exists() and not module.exists()
    assert (cache.inductor_dir / "k7" / ("ck7" + "a" * 49 + ".main.cpp")).is_file()
    (kept,) = [p for p in (cache.directory / "quarantine").rglob(library.name)]
    assert kept.read_bytes() == b"\x7fELF someone else's"
    assert manifest.check(cache, KEY) == []  # moved once


def test_a_later_record_keeps_earlier_files_still_there_and_adds_new_ones(cache, monkeypatch):
    from torch._inductor.codecache import PyCodeCache

    manifest.record(cache, [KEY])
    monkeypatch.setattr(PyCodeCache, "modules", [])  # the next run imported nothing new
    cache.artifact_keys = {}
    manifest.record(cache, [KEY])
    recorded = json.loads((cache.directory / "manifests" / f"{KEY}.json").read_text())["files"]
    assert "inductor/zz/czzoutput.py" in recorded and "inductor/fxgraph/q4/fq4key/pickled" in recorded


def test_an_unreadable_or_hostile_record_checks_nothing_and_moves_nothing_outside(cache, tmp_path):
    folder = cache.directory / "manifests"
    folder.mkdir()
    (folder / f"{KEY}.json").write_text("{not json")
    assert manifest.check(cache, KEY) == []
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    (folder / f"{KEY}.json").write_text(json.dumps({"files": {"inductor/../../outside.txt": "0" * 64,
                                                              "kiln/../outside.txt": "0" * 64}}))
    assert manifest.check(cache, KEY) == [] and outside.read_text() == "mine"
