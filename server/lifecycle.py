"""The server's exit status when its engine dies.

vLLM 0.32's API server notices a dead engine core (a killed worker or engine process, a fatal
error in a step), fails the requests in flight and shuts down, but the process then exits with
status 0, as after a requested stop: a supervisor (systemd, Kubernetes, a test) cannot tell a
crash from a stop. vLLM stops its engine client with `shutdown()` in both cases: on SIGTERM /
SIGINT while the engine still runs, and after a death once serving has ended. So `EngineWatch`
looks at the client when `shutdown()` is first called: already `errored` means the engine died
first. It also polls `errored` from the event loop, to log the death the moment it happens.
Either way: one log line, and the process exits with `EXIT_ENGINE_DIED` after vLLM's shutdown.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys

logger = logging.getLogger("vllm.kvevict")

EXIT_ENGINE_DIED = 70  # EX_SOFTWARE
POLL_S = 0.25


class EngineWatch:
    def __init__(self) -> None:
        self.client = None
        self.stop_requested = False  # shutdown() was called while the engine was alive
        self.died: str | None = None  # why, once the engine died unrequested
        self.stopped = False  # vLLM's shutdown() returned: the engine reports nothing more
        self._task: asyncio.Task | None = None

    @property
    def started(self) -> bool:
        return self.client is not None

    def start(self, app) -> None:
        """From the first ASGI scope (the event loop runs; vLLM set app.state.engine_client)."""
        if self.client is not None:
            return
        client = getattr(getattr(app, "state", None), "engine_client", None)
        if client is None or not hasattr(client, "errored") or not hasattr(client, "shutdown"):
            return
        self.client = client
        stock_shutdown = client.shutdown

        def shutdown(*args, **kwargs):  # vLLM's launcher (SIGTERM) and its client context
            if not self.stop_requested and self.died is None:
                if client.errored:
                    self._on_death()
                else:
                    self.stop_requested = True
            try:
                return stock_shutdown(*args, **kwargs)
            finally:
                self.stopped = True

        client.shutdown = shutdown  # this one object's method: contract.RELIED_ON
        atexit.register(self._exit_status)
        self._task = asyncio.get_running_loop().create_task(self._watch())

    @property
    def engine_gone(self) -> bool:
        """No stats will come from the engine any more: stopped, or dead."""
        return self.stopped or self.died is not None or (
            self.client is not None and bool(self.client.errored))

    async def _watch(self) -> None:
        while not self.stop_requested and self.died is None:
            if self.client.errored:
                if not self.stop_requested:
                    self._on_death()
                return
            await asyncio.sleep(POLL_S)

    def _on_death(self) -> None:
        try:
            cause = repr(self.client.dead_error)
        except Exception as exc:  # noqa: BLE001  (the reason is only for the log line)
            cause = repr(exc)
        self.died = cause
        logger.error("vllm-kvevict: the engine died while serving (%s): vLLM fails the "
                     "requests in flight and shuts down; the server exits with status %d",
                     cause, EXIT_ENGINE_DIED)

    def _exit_status(self) -> None:
        # Registered once serving starts, so it runs after the exit handlers vLLM registers
        # later (LIFO) and before the interpreter's own: then the status is ours.
        if self.died is None and not self.stop_requested and self.client.errored:
            self._on_death()  # died and was never stopped by vLLM
        if self.died is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_ENGINE_DIED)


WATCH = EngineWatch()
