"""Whose compiled code Kiln loads (kiln/compile/artifacts/trust.py): a cache folder that is the user's alone,
a signing key that is the user's secret, and signatures that say a bundle was not changed."""

import os
import stat
import time

import pytest

from kiln.compile.artifacts import bundle
from kiln.compile.artifacts.cache import INDUCTOR_ENV, CompileCache
from kiln.compile.artifacts.trust import (ENV_KEY, KEY_FILE, KilnTrustWarning, folder_problem, key_id, signature,
                                          signature_problem, signing_key)

POSIX = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
KEY = b"a-key-of-at-least-thirty-two-characters"


@POSIX
@pytest.mark.parametrize("mode, who", [(0o777, "every user"), (0o775, "its group"), (0o1777, "every user")])
def test_a_cache_folder_other_users_can_write_to_is_refused_and_nothing_is_loaded_from_it(tmp_path, mode, who):
    folder = tmp_path / "shared-cache"
    folder.mkdir()
    folder.chmod(mode)  # with the sticky bit too: others could still plant a file Kiln has not written yet
    cache = CompileCache(folder)
    with pytest.warns(KilnTrustWarning, match=rf"the Kiln cache folder {folder} is refused because {who} can write "
                                              rf"to it \(mode {stat.S_IMODE(mode):04o}\).*chmod go-w"):
        cache.activate()
    assert not cache.enabled and cache.load("ab" * 16) is False
    assert not (folder / "inductor").exists() and os.environ.get(INDUCTOR_ENV) != str(folder / "inductor")


@POSIX
@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown to another user needs root")
def test_a_cache_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 4321, 4321)
    cache = CompileCache(folder)
    with pytest.warns(KilnTrustWarning, match=r"belongs to another user \(uid 4321"):
        cache.activate()
    assert not cache.enabled


@POSIX
def test_a_users_inductor_folder_others_can_write_to_is_refused_and_said_to_stay_in_use(tmp_path, monkeypatch):
    inductor = tmp_path / "their-inductor"
    inductor.mkdir()
    inductor.chmod(0o777)
    monkeypatch.setenv(INDUCTOR_ENV, str(inductor))
    cache = CompileCache(tmp_path / "kiln")
    with pytest.warns(KilnTrustWarning, match=r"the Inductor folder TORCHINDUCTOR_CACHE_DIR names .* \(Inductor "
                                              r"itself still uses it"):
        cache.activate()
    assert not cache.enabled


@POSIX
def test_kiln_makes_its_folders_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # a user-private-group system: new folders group-writable
    try:
        cache = CompileCache(tmp_path / "new" / "kiln")
        cache.activate()
    finally:
        os.umask(old)
    assert cache.enabled
    assert stat.S_IMODE(cache.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(cache.inductor_dir.stat().st_mode) == 0o700
    assert folder_problem(cache.directory) is None


def test_the_key_comes_from_the_environment_before_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY, raising=False)
    assert signing_key(tmp_path) is None and not (tmp_path / KEY_FILE).exists()  # checking makes no key
    made = signing_key(tmp_path, create=True)
    assert made == (tmp_path / KEY_FILE).read_text().strip().encode() and signing_key(tmp_path) == made
    monkeypatch.setenv(ENV_KEY, "  " + KEY.decode() + "\n")
    assert signing_key(tmp_path) == KEY and signing_key(None) == KEY
    monkeypatch.setenv(ENV_KEY, "x" * 31)
    with pytest.raises(ValueError, match="holds 31 characters"):
        signing_key(tmp_path)


def test_signature_problems_name_what_is_wrong():
    header = {"format": 1, "keys": [], "machine": {}, "payload_sha256": "00", "payload_bytes": 3}
    payload = b"abc"
    assert "carries no signature" in signature_problem(header, payload, KEY)
    signed = dict(header, signed_by=key_id(KEY))
    signed["signature"] = signature(KEY, signed, payload)
    assert signature_problem(signed, payload, KEY) is None
    assert "does not match its contents" in signature_problem(signed, b"abd", KEY)
    assert "does not match its contents" in signature_problem(dict(signed, keys=["ff" * 32]), payload, KEY)
    assert "holds no signing key" in signature_problem(signed, payload, None)
    other = b"another-key-of-at-least-thirty-two-chars"
    assert f"not with this job's key {key_id(other)}" in signature_problem(signed, payload, other)
    assert key_id(KEY) != key_id(other) and KEY.hex()[:16] not in key_id(KEY)


def test_checking_a_signature_costs_little_beside_reading_the_bundle(tmp_path):
    # The bound is 50 ms for a few MB; measured here as the print shows (noisy machines: a
    # generous assertion, the number is in the output).
    files = {}
    for i in range(4):
        path = tmp_path / f"kernel{i}.so"
        path.write_bytes(os.urandom(1_000_000))
        files[f"inductor/k{i}/kernel{i}.so"] = path
    target = tmp_path / "compile_artifacts.kiln"
    bundle.write_bundle(target, files, ["f" * 64], "cpu", KEY)
    start = time.perf_counter()
    vouched = bundle.vouch_for(target, KEY)
    seconds = time.perf_counter() - start
    print(f"vouch_for on a {target.stat().st_size / 1e6:.1f} MB bundle: {seconds * 1e3:.1f} ms")
    assert vouched.sha256 is not None and seconds < 1.0


def test_clearing_the_cache_keeps_the_signing_key(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY, raising=False)
    cache = CompileCache(tmp_path / "kiln")
    key = signing_key(cache.directory, create=True)
    (cache.directory / "manifests").mkdir()
    (cache.directory / "quarantine").mkdir()
    cache.clear()
    assert signing_key(cache.directory) == key
    assert not (cache.directory / "manifests").exists() and not (cache.directory / "quarantine").exists()
