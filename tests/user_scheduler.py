"""A user's own scheduler and worker classes (`--scheduler-cls
user_scheduler.StepLoggingScheduler`, `--worker-cls user_scheduler.StepLoggingWorker`), for
tests/test_scheduler_class.py: vLLM Scheduler and CPUWorker subclasses that log their first
step."""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.cpu_worker import CPUWorker

logger = logging.getLogger("vllm.user_scheduler")  # vLLM's handler: the server's log


class StepLoggingScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        if not getattr(self, "_logged", False):
            self._logged = True
            logger.warning("user scheduler: first step, under %s", type(self).__mro__[1].__name__)
        return output


class StepLoggingWorker(CPUWorker):
    """A user's own worker class (`--worker-cls user_scheduler.StepLoggingWorker`)."""

    def execute_model(self, scheduler_output):
        if not getattr(self, "_logged", False):
            self._logged = True
            logger.warning("user worker: first step, under %s", type(self).__mro__[1].__name__)
        return super().execute_model(scheduler_output)
