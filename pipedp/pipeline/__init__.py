"""Microbatching, schedules as data, the dry-run simulator and the stream executor."""

from .microbatch import count, gather, shares, sizes, split
from .schedule import SCHEDULES, Action, forward_only, get_schedule, gpipe, one_f_one_b
from .simulate import ScheduleError, Simulation, simulate

__all__ = [
    "count", "gather", "shares", "sizes", "split", "SCHEDULES", "Action", "forward_only", "get_schedule",
    "gpipe", "one_f_one_b", "ScheduleError", "Simulation", "simulate",
]
