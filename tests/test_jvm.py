"""The drivers' class archive (``tests/jvm.py``): made once, by one process, and never waited for."""

from __future__ import annotations

import fcntl
import subprocess
import threading
from types import SimpleNamespace

from tests import jvm


def _archive_in(monkeypatch, tmp_path):
    archive = tmp_path / "driver-test.jsa"
    monkeypatch.setattr(jvm, "ARCHIVE_DIR", tmp_path)
    monkeypatch.setattr(jvm, "class_archive", lambda: archive)
    return archive


def test_the_archive_is_made_once_and_used_once_it_exists(monkeypatch, tmp_path):
    archive = _archive_in(monkeypatch, tmp_path)
    runs = []

    def dump(command, **kwargs):  # the JVM writes the archive at the path its option names as it exits
        runs.append(command)
        partial = command[-1].split("-XX:ArchiveClassesAtExit=")[1]
        with open(partial, "wb") as out:
            out.write(b"classes")
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", dump)
    assert "SharedArchiveFile" not in jvm.driver_jvm_options()
    jvm.ensure_class_archive()
    jvm.ensure_class_archive()
    assert len(runs) == 1 and archive.read_bytes() == b"classes"
    assert jvm.driver_jvm_options().endswith(f"-XX:SharedArchiveFile={archive}")
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".partial"] == []


def test_a_process_that_finds_the_archive_being_made_does_not_wait_for_it(monkeypatch, tmp_path):
    archive = _archive_in(monkeypatch, tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("made twice")))
    with open(tmp_path / "archive.lock", "w") as held:  # another worker is making it
        fcntl.flock(held, fcntl.LOCK_EX)
        caller = threading.Thread(target=jvm.ensure_class_archive, daemon=True)
        caller.start()
        caller.join(timeout=10)
        assert not caller.is_alive(), "ensure_class_archive waited for the process making the archive"
    assert not archive.exists() and jvm.driver_jvm_options() == jvm.JVM_OPTIONS
