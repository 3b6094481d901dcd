"""A user's own scheduler class (`--scheduler-cls user_scheduler.StepLoggingScheduler`), for
tests/test_scheduler_class.py: a vLLM Scheduler subclass that logs its first step."""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler

logger = logging.getLogger("vllm.user_scheduler")  # vLLM's handler: the server's log


class StepLoggingScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        if not getattr(self, "_logged", False):
            self._logged = True
            logger.warning("user scheduler: first step, under %s", type(self).__mro__[1].__name__)
        return output
