"""The Inductor cache the flex path compiles into, guarded against a process killed mid-compile.

torch keeps compiled kernels in one directory per user (`/tmp/torchinductor_<user>`); four times
a flex server's worker died at its first step ("cancelled") after earlier servers had been
killed while compiling, and a fresh directory cured it (docs/flex_attention.md). So the worker
serving the flex path compiles into a directory keyed by torch's, vLLM's and the plugin's
versions, and marks it while it compiles (torch's compile start / end callbacks). vLLM
force-kills its workers at shutdown but not mid-compile, so a mark whose process is gone means
a compilation was cut off: the directory is set aside (logged) before anything compiles into
it. A user's `TORCHINDUCTOR_CACHE_DIR` is used as given, with the same marks.
"""

from __future__ import annotations

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
MARKS = ".vllm-kvevict-compiling"  # a file per process compiling now: its pid, its start time


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


def directory_for(environ=os.environ) -> Path:
    """Where this process's compilations go: the user's TORCHINDUCTOR_CACHE_DIR, or the keyed
    directory under torch's default."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = Path(default_cache_dir())
    # (torch exports its default into the environment on first use, which our processes
    # inherit: that is not a user's choice)
    if environ.get(ENV) and Path(environ[ENV]).resolve() != default.resolve():
        return Path(environ[ENV])
    return default / f"vllm-kvevict-{cache_key()}"


def guard(environ=os.environ) -> Path:
    """Before the first compilation in this process: choose the directory (setting
    TORCHINDUCTOR_CACHE_DIR), set it aside if a process was cut off compiling there, and mark
    it during each of this process's compilations. Returns the directory."""
    directory = directory_for(environ)
    environ[ENV] = str(directory)
    marks = directory / MARKS
    cut_off = [m for m in marks.glob("*") if not _alive(m)] if marks.is_dir() else []
    if cut_off:
        live = [m for m in marks.glob("*") if _alive(m)]
        pids = sorted(m.name for m in cut_off)
        if live:  # another server compiles here now: setting it aside would pull it away
            logger.warning("vllm-kvevict: the Inductor cache %s holds compilations cut off in "
                           "process(es) %s and is in use by %d running process(es): kept; if "
                           "the flex path then stops at its first step, remove it", directory,
                           pids, len(live))
            for mark in cut_off:
                mark.unlink(missing_ok=True)
        else:
            aside = directory.with_name(f"{directory.name}.stale-{time.time_ns()}")
            try:
                directory.rename(aside)
            except FileNotFoundError:  # another rank of this server set it aside first
                pass
            shutil.rmtree(aside, ignore_errors=True)
            logger.warning("vllm-kvevict: the Inductor cache %s holds compilations cut off in "
                           "process(es) %s (killed mid-compile: a half-written entry stops the "
                           "flex path at its first step): starting from an empty one",
                           directory, pids)
    mark_compilations(marks)
    return directory


def mark_compilations(marks: Path) -> None:
    """This process's mark in `marks` from the start to the end of each compilation."""
    from torch._dynamo.callback import callback_handler

    mine = marks / str(os.getpid())
    stamp = f"{os.getpid()} {_started(os.getpid())}"

    def started(_args) -> None:
        marks.mkdir(parents=True, exist_ok=True)
        mine.write_text(stamp)

    def ended(_args) -> None:
        mine.unlink(missing_ok=True)

    callback_handler.register_start_callback(started)
    callback_handler.register_end_callback(ended)
