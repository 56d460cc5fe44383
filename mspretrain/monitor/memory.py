"""Memory figures logged with a run: host RSS and, on Ascend, the device's own statistics.

Design choices: these are two metrics, not one. `mem_mb` is the host process's peak resident set
(`ru_maxrss`), which on Ascend says nothing about the NPU's 64 GB. `device_mem_mb` and
`device_mem_reserved_mb` are MindSpore's runtime statistics of the device memory pool since the
process started: peak bytes held by tensors (`mindspore.runtime.max_memory_allocated`) and peak
bytes the pool reserved from the device (`max_memory_reserved`), both read from
`_memory_stats(device_target)` in mindspore/runtime/memory.py (MindSpore 2.10). Reserved is what
an out-of-memory error compares with the device's capacity; reserved minus allocated is the pool's
fragmentation and caching. On CPU MindSpore reports 0 for both ("For the CPU backend, 0 is always
returned"), so the device keys are left out there rather than logged as a false 0. Reading the
statistics does not synchronise the device (they are host-side counters of the pool).
"""
from __future__ import annotations

import resource

MB = 1024 * 1024


def host_rss_mb() -> float:
    """Peak resident set of this process in MB (Linux reports ru_maxrss in KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_memory_mb(target: str) -> dict[str, float]:
    """{"device_mem_mb": peak allocated, "device_mem_reserved_mb": peak reserved} on Ascend, {} elsewhere."""
    if target != "ascend":
        return {}
    import mindspore as ms

    return {"device_mem_mb": ms.runtime.max_memory_allocated() / MB,
            "device_mem_reserved_mb": ms.runtime.max_memory_reserved() / MB}


def memory_metrics(target: str) -> dict[str, float]:
    """The memory keys of one metrics record: host RSS always, device memory where there is one."""
    return {"mem_mb": host_rss_mb(), **device_memory_mb(target)}
