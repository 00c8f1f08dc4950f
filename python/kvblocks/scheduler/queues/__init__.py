"""Queues of the scheduler: the waiting queue and its admission policies."""

from kvblocks.scheduler.queues.policy import SchedulingPolicy, WaitingQueue, make_policy

__all__ = ["SchedulingPolicy", "WaitingQueue", "make_policy"]
