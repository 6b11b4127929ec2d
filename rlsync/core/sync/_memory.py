"""How much memory is free where a landing would be allocated: the bound on what a peer may ask a reader for."""

from __future__ import annotations

import os

import torch


def free_memory(device: str | None) -> int:
    """Bytes free on ``device`` (a CUDA device: what the driver reports free, plus what torch's allocator holds
    unused and would hand out first), else host memory this process could still get (Linux's MemAvailable;
    elsewhere the physical memory)."""
    if device is not None and torch.device(device).type == "cuda":
        cuda = torch.device(device)
        cached = torch.cuda.memory_reserved(cuda) - torch.cuda.memory_allocated(cuda)
        return int(torch.cuda.mem_get_info(cuda)[0] + cached)
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
