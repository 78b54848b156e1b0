"""The host's CPUs as this process sees them (torch-free: the pool reads it before the fork
server starts)."""
from __future__ import annotations

import os


def cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
