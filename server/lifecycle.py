"""The server's exit status when its engine dies.

vLLM 0.32's API server notices a dead engine core (a killed worker or engine process, a fatal
error in a step), fails the requests in flight and shuts down, but the process then exits with
status 0, as after a requested shutdown: a supervisor (systemd, Kubernetes, a test) cannot tell
a crash from a stop. `EngineWatch` polls the engine client's `errored` from the API server's
event loop; if it turns true while no shutdown was requested (SIGTERM / SIGINT, seen as vLLM's
own "shutdown triggered" log line), it logs one line naming the cause and makes the process
exit with `EXIT_ENGINE_DIED` once vLLM's shutdown is done.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys

logger = logging.getLogger("vllm.kvevict")

EXIT_ENGINE_DIED = 70  # EX_SOFTWARE
POLL_S = 0.5
SHUTDOWN_LOGGER = "vllm.entrypoints.launchers.launcher"  # logs "[shutdown] ... triggered"
SHUTDOWN_MARK = "shutdown triggered"


class EngineWatch(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.shutdown_requested = False
        self.died: str | None = None
        self._task: asyncio.Task | None = None

    # a logging filter on vLLM's launcher logger: it never drops a record
    def filter(self, record: logging.LogRecord) -> bool:
        if SHUTDOWN_MARK in str(record.msg):
            self.shutdown_requested = True
        return True

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self, app) -> None:
        """From the first ASGI scope (the event loop runs; vLLM set app.state.engine_client)."""
        if self._task is not None:
            return
        client = getattr(getattr(app, "state", None), "engine_client", None)
        if client is None or not hasattr(client, "errored"):
            return
        logging.getLogger(SHUTDOWN_LOGGER).addFilter(self)
        atexit.register(self._exit_status)
        self._task = asyncio.get_running_loop().create_task(self._watch(client))

    async def _watch(self, client) -> None:
        while not self.shutdown_requested:
            if client.errored:
                if not self.shutdown_requested:
                    self._on_death(client)
                return
            await asyncio.sleep(POLL_S)

    def _on_death(self, client) -> None:
        try:
            cause = repr(client.dead_error)
        except Exception as exc:  # noqa: BLE001  (the reason is only for the log line)
            cause = repr(exc)
        self.died = cause
        logger.error("vllm-kvevict: the engine died while serving (%s): vLLM fails the "
                     "requests in flight and shuts down; the server exits with status %d",
                     cause, EXIT_ENGINE_DIED)

    def _exit_status(self) -> None:
        # Registered once serving starts, so it runs after the exit handlers vLLM registers
        # later (LIFO) and before the interpreter's own: then the status is ours.
        if self.died is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_ENGINE_DIED)


WATCH = EngineWatch()
