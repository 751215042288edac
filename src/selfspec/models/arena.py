"""The CPU runtime's weight matrices in one block of memory backed by 2 MiB pages, in the order a
decoding step reads them.

A one-token step of a small model on a memory-bound CPU streams every weight matrix once. From
memory in 4 KiB pages, the hardware prefetchers stop at every page boundary and every page is a
TLB miss; Linux backs an anonymous mapping marked ``MADV_HUGEPAGE`` with 2 MiB pages when its
transparent huge pages are ``madvise`` or ``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``;
``madvise`` is the common default, under which torch's own allocations stay in 4 KiB pages).

:func:`block` maps such a region; :func:`place` lays tensors of given shapes out in it, each
starting on a 4 KiB boundary. :class:`~selfspec.models.layered.LayeredModel` copies its linears'
weights there on CPU: the values are copied, not changed, so every output is bit-identical.
Where the platform has no ``madvise`` (not Linux) nothing is placed and the weights stay where
they are. Measured effect: docs/2026-11-27-cpu-results.md, "Vanilla against llama.cpp".
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Sequence

import torch

#: the huge page size Linux uses for transparent huge pages on x86-64 and most arm64 kernels
HUGE_PAGE = 2 << 20
#: where each tensor starts: a page boundary, so no two tensors share a page's TLB entry at an edge
ALIGN = 4096
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this platform can ask for huge pages (Linux's ``madvise(MADV_HUGEPAGE)``)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or None
    where the setting cannot be read."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    return next((word[1:-1] for word in text.split() if word.startswith("[")), None)


def block(nbytes: int) -> torch.Tensor:
    """A zeroed ``uint8`` CPU tensor of ``nbytes`` starting on a 2 MiB boundary, in an anonymous
    mapping marked ``MADV_HUGEPAGE``. The tensor keeps the mapping alive."""
    if not available():
        raise OSError("huge pages need Linux's madvise(MADV_HUGEPAGE)")
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    return raw[start:start + nbytes]


def place(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Empty contiguous tensors of ``shapes`` and ``dtype``, laid out in order in one huge-page
    :func:`block`, each on a 4 KiB boundary."""
    size = dtype.itemsize
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-math.prod(shape) * size // ALIGN) * ALIGN
    memory = block(max(end, 1))
    return [memory[o:o + math.prod(s) * size].view(dtype).view(*s) for o, s in zip(offsets, shapes)]


def huge_page_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of the mapping holding ``tensor`` that the kernel backs with huge pages
    (``AnonHugePages`` in ``/proc/self/smaps``), or None where that cannot be read."""
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None
