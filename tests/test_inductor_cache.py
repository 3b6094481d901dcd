"""The flex path's Inductor cache guard (`integration/attention/inductor_cache.py`), with real
processes and torch's own compile callbacks: a process killed while it compiles leaves its mark
and the next guard sets the directory aside; a finished compilation leaves no mark; a process
compiling now keeps the directory; the default directory is keyed by the builds. (Served: the
flex worker's marks in tests/test_flex_vllm.py.)"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.callback import CallbackTrigger, callback_handler

from vllm_kvevict.integration.attention import inductor_cache

# a process that takes the guard, writes an "entry" and then compiles: inside one of torch's
# compilations that waits (`hang`), or a real one that ends (`compile`)
CHILD = """
import sys, time
import torch
from torch._dynamo.callback import CallbackTrigger, callback_handler
from vllm_kvevict.integration.attention import inductor_cache
directory = inductor_cache.guard()
(directory / "entry.so").write_bytes(b"half-written")
if sys.argv[1] == "hang":
    with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0"):
        print("ready", flush=True)
        time.sleep(600)
torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
print("ready", flush=True)
"""


@pytest.fixture(autouse=True)
def own_callbacks():
    """The guards taken in this process register torch callbacks: removed after each test."""
    start, end = list(callback_handler.start_callbacks), list(callback_handler.end_callbacks)
    yield
    callback_handler.start_callbacks[:] = start
    callback_handler.end_callbacks[:] = end


def child(directory, mode: str) -> subprocess.Popen:
    env = {**os.environ, inductor_cache.ENV: str(directory)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def marks(directory) -> list[str]:
    return sorted(p.name for p in (directory / inductor_cache.MARKS).glob("*"))


def killed(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_compilation_cut_off_sets_the_directory_aside(tmp_path, caplog):
    directory = tmp_path / "inductor"
    proc = child(directory, "hang")
    assert marks(directory) == [str(proc.pid)]  # marked while it compiles
    killed(proc)
    assert (directory / "entry.so").exists() and marks(directory) == [str(proc.pid)]
    with caplog.at_level(logging.WARNING, logger="vllm.kvevict"):
        assert inductor_cache.guard({inductor_cache.ENV: str(directory)}) == directory
    assert not directory.exists() or not (directory / "entry.so").exists()
    assert str(proc.pid) in caplog.text and "starting from an empty one" in caplog.text
    assert not list(tmp_path.glob("inductor.stale-*"))


def test_a_finished_compilation_leaves_no_mark_and_a_kill_then_keeps_the_cache(tmp_path,
                                                                                  caplog):
    """vLLM force-kills its workers at shutdown: a worker killed after it compiled keeps its
    cache for the next server."""
    directory = tmp_path / "inductor"
    proc = child(directory, "compile")
    assert marks(directory) == []  # torch's end callback took the mark away
    killed(proc)
    with caplog.at_level(logging.WARNING, logger="vllm.kvevict"):
        inductor_cache.guard({inductor_cache.ENV: str(directory)})
    assert (directory / "entry.so").exists() and caplog.text == ""


def test_a_directory_another_process_compiles_in_is_kept(tmp_path, caplog):
    """A cut-off mark beside a live one: the directory stays (pulling it from under a running
    server would break it), the cut-off mark goes, and the log says what to do."""
    directory = tmp_path / "inductor"
    live = child(directory, "hang")
    gone = child(directory, "hang")
    killed(gone)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.kvevict"):
            inductor_cache.guard({inductor_cache.ENV: str(directory)})
        assert (directory / "entry.so").exists() and marks(directory) == [str(live.pid)]
        assert "kept" in caplog.text and str(gone.pid) in caplog.text
    finally:
        killed(live)


def test_this_process_marks_its_own_compilations(tmp_path):
    directory = tmp_path / "inductor"
    inductor_cache.guard({inductor_cache.ENV: str(directory)})
    with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0"):
        assert marks(directory) == [str(os.getpid())]
    assert marks(directory) == []


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
    """Also where torch exported its own default into the environment (its `cache_dir()` does
    on first use, and child processes inherit it): that is not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    for env in ({}, {inductor_cache.ENV: default_cache_dir()}):
        directory = inductor_cache.directory_for(env)
        assert directory.parent == Path(default_cache_dir())
        assert directory.name == f"vllm-kvevict-{inductor_cache.cache_key()}"
    user = {inductor_cache.ENV: "/somewhere/mine"}
    assert inductor_cache.directory_for(user) == Path("/somewhere/mine")
    assert len(inductor_cache.cache_key()) == 12
    assert torch.__version__  # (the key's first part)
