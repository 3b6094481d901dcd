"""The flex path's Inductor cache guard (`integration/attention/inductor_cache.py`), with real
processes: a mark left by a process killed after it compiled sets the directory aside; a clean
exit leaves no mark; a running process's mark keeps the directory; the default directory is
keyed by the builds."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from vllm_kvevict.integration.attention import inductor_cache

# a process that takes the guard, writes an "entry", reports, and waits (or exits)
CHILD = """
import os, sys, time
from pathlib import Path
from vllm_kvevict.integration.attention import inductor_cache
directory = inductor_cache.guard()
(directory / "entry.so").write_bytes(b"half-written")
print("ready", flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


def child(directory, mode: str) -> subprocess.Popen:
    env = {**os.environ, inductor_cache.ENV: str(directory)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def marks(directory) -> list[str]:
    return sorted(p.name for p in (directory / inductor_cache.MARKS).glob("*"))


def test_a_killed_compilers_directory_is_set_aside(tmp_path, caplog):
    directory = tmp_path / "inductor"
    proc = child(directory, "wait")
    assert marks(directory) == [str(proc.pid)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (directory / "entry.so").exists() and marks(directory) == [str(proc.pid)]
    env = {inductor_cache.ENV: str(directory)}
    with caplog.at_level(logging.WARNING, logger="vllm.kvevict"):
        assert inductor_cache.guard(env) == directory
    assert not (directory / "entry.so").exists()  # the planted entry is gone
    assert marks(directory) == [str(os.getpid())]
    assert str(proc.pid) in caplog.text and "starting from an empty one" in caplog.text
    assert not list(tmp_path.glob("inductor.stale-*"))


def test_a_clean_exit_leaves_no_mark_and_the_entries_stay(tmp_path, caplog):
    directory = tmp_path / "inductor"
    proc = child(directory, "exit")
    assert proc.wait() == 0 and marks(directory) == []
    with caplog.at_level(logging.WARNING, logger="vllm.kvevict"):
        inductor_cache.guard({inductor_cache.ENV: str(directory)})
    assert (directory / "entry.so").exists() and caplog.text == ""


def test_a_running_compilers_directory_is_kept(tmp_path, caplog):
    """A stale mark beside a live one: the directory stays (pulling it from under a running
    server would break it), the stale mark goes, and the log says what to do."""
    directory = tmp_path / "inductor"
    live = child(directory, "wait")
    gone = child(directory, "wait")
    gone.send_signal(signal.SIGKILL)
    gone.wait()
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.kvevict"):
            inductor_cache.guard({inductor_cache.ENV: str(directory)})
        assert (directory / "entry.so").exists()
        assert marks(directory) == sorted([str(live.pid), str(os.getpid())])
        assert "kept" in caplog.text and str(gone.pid) in caplog.text
    finally:
        live.kill()
        live.wait()


def test_a_reused_pid_is_not_taken_for_the_process_that_left_the_mark(tmp_path):
    """The mark records its process's start time: this process's pid with another start time
    is a process that is gone."""
    directory = tmp_path / "inductor"
    (directory / inductor_cache.MARKS).mkdir(parents=True)
    (directory / inductor_cache.MARKS / "1").write_text(f"{os.getpid()} {time.time() - 1e6}")
    (directory / "entry.so").write_bytes(b"x")
    inductor_cache.guard({inductor_cache.ENV: str(directory)})
    assert not (directory / "entry.so").exists()


def test_the_default_directory_is_keyed_by_the_builds():
    env: dict = {}
    directory = inductor_cache.guard(env)
    assert env[inductor_cache.ENV] == str(directory)
    assert directory.name == f"vllm-kvevict-{inductor_cache.cache_key()}"
    assert len(inductor_cache.cache_key()) == 12
