"""The Inductor cache the flex path compiles into, guarded against a process killed mid-compile.

torch keeps compiled kernels in one directory per user (`/tmp/torchinductor_<user>`). Three
times here a flex server's worker died at its first step without a traceback after an earlier
server had been killed while compiling, and a fresh directory cured it each time
(docs/flex_attention.md). So the worker serving the flex path (1) compiles into a directory
keyed by torch's, vLLM's and the plugin's versions, where no other build's entry can load, and
(2) marks that directory in use while it runs. vLLM's worker exits through SystemExit on
SIGTERM, so the mark goes with a clean exit; a mark whose process is gone means an entry may be
half-written, and the directory is set aside (logged) before anything compiles into it.
A user's `TORCHINDUCTOR_CACHE_DIR` is used as given, with the same marks.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import time
from importlib import metadata
from pathlib import Path

import psutil

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

ENV = "TORCHINDUCTOR_CACHE_DIR"
MARKS = ".vllm-kvevict-in-use"  # one file per process compiling here: its pid, its start time


def cache_key() -> str:
    """The builds whose compiled entries may share a directory."""
    import torch
    import vllm

    try:
        ours = metadata.version("vllm-kvevict")
    except metadata.PackageNotFoundError:
        ours = "source"
    text = f"torch {torch.__version__} vllm {vllm.__version__} vllm-kvevict {ours}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def _alive(mark: Path) -> bool:
    """The mark's process still runs (the same process: a reused pid starts at another time)."""
    try:
        pid, started = mark.read_text().split()
        return _started(int(pid)) == float(started)
    except (OSError, ValueError):
        return False


def guard(environ=os.environ) -> Path:
    """Before the first compilation in this process: choose the directory (setting
    TORCHINDUCTOR_CACHE_DIR), set it aside if a process that compiled there is gone, and mark
    it in use until this process exits. Returns the directory."""
    if environ.get(ENV):
        directory = Path(environ[ENV])
    else:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        directory = Path(default_cache_dir()) / f"vllm-kvevict-{cache_key()}"
        environ[ENV] = str(directory)
    marks = directory / MARKS
    left = [m for m in marks.glob("*") if not _alive(m)] if marks.is_dir() else []
    if left:
        live = [m for m in marks.glob("*") if _alive(m)]
        pids = sorted(m.name for m in left)
        if live:  # another server compiles here now: setting it aside would pull it away
            logger.warning("vllm-kvevict: the Inductor cache %s was in use by process(es) %s, "
                           "gone without closing it (killed?), and is in use by %d running "
                           "process(es): kept; if the flex path then stops at its first step, "
                           "remove it", directory, pids, len(live))
            for mark in left:
                mark.unlink(missing_ok=True)
        else:
            aside = directory.with_name(f"{directory.name}.stale-{time.time_ns()}")
            try:
                directory.rename(aside)
            except FileNotFoundError:  # another rank of this server set it aside first
                pass
            shutil.rmtree(aside, ignore_errors=True)
            logger.warning("vllm-kvevict: the Inductor cache %s was in use by process(es) %s, "
                           "gone without closing it (killed mid-compile leaves entries that stop "
                           "the flex path at its first step): starting from an empty one",
                           directory, pids)
    marks.mkdir(parents=True, exist_ok=True)
    mine = marks / str(os.getpid())
    mine.write_text(f"{os.getpid()} {_started(os.getpid())}")
    atexit.register(mine.unlink, missing_ok=True)
    return directory
