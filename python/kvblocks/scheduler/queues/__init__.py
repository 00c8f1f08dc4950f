"""Queues of the scheduler: the waiting queue, its admission policies, and the holds of
requests waiting for a prefix computed in the same step."""

from kvblocks.scheduler.queues.policy import SchedulingPolicy, WaitingQueue, make_policy
from kvblocks.scheduler.queues.prefix_hold import PrefixHold

__all__ = ["PrefixHold", "SchedulingPolicy", "WaitingQueue", "make_policy"]
