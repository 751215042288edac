"""CPU results that do not depend on the thread count, on every CPU: MKL's conditional numerical
reproducibility (CNR) mode, strict.

torch's float32 GEMM on the CPU is MKL's: training, the transformers peers, and with
``model.linear_kernel=torch`` the prompt's prefill and any pass of more than
:data:`~selfspec.models.kernels.MAX_ROWS` rows (PPD's larger trees); with the runtime's kernels those
take oneDNN's matmul (:func:`~selfspec.models.kernels.wide_path`). MKL may split a
product differently on one and on two threads, and then the sums round differently. On the AMD
EPYC machines (AVX2) this project was developed on the bits happened to agree; on an Intel Xeon
(Sapphire Rapids: AVX-512, AMX) an 80-row prefill of a 3-layer model gave logits up to 6e-5 apart
on one and two threads, and every decoding pass after it differed too. The thread policy
(:mod:`selfspec.decoding.threads`) switches thread counts mid-generation, so this is a property of
the outputs, not only of a test.

MKL's strict CNR mode (``MKL_CBWR=AUTO,STRICT``: the code path MKL would choose for this CPU,
with results bitwise independent of the thread count) removes it. MKL reads the setting from the
environment once, at its first call, and refuses to change it afterwards, so :func:`set_default`
runs when the package is imported (``selfspec/__init__.py``), before any matrix product. A value
the user set is kept as it is; :func:`mode` reports the mode MKL actually runs, every run records
it (:func:`selfspec.store.runinfo.hardware`), and ``threads=adaptive`` refuses to switch thread counts
under a mode that is not strict (:func:`selfspec.decoding.threads.why_not_adaptive`).

What strict mode costs was measured on the Intel machine (``scripts/bench_cbwr.py``; docs/2026-11-27-cpu-results.md, "On each kind
of CPU").

The runtime's own CPU operators (the skinny linear, row-wise attention, the fused norm and rotary)
compute each output element by one instruction sequence whatever the thread count; they need no
mode.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

#: the environment variable MKL reads its CNR mode from
VARIABLE = "MKL_CBWR"
#: selfspec's default: MKL's own choice of code path for this CPU, bitwise independent of threads
DEFAULT = "AUTO,STRICT"

# mkl_cbwr.h: the branch in the low bits, the strict flag above them
_STRICT = 0x10000
_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
             10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}


def set_default() -> None:
    """Ask MKL for :data:`DEFAULT` unless the user chose a mode (their value is never replaced).
    It takes effect if MKL has not run yet in this process: :func:`mode` tells."""
    os.environ.setdefault(VARIABLE, DEFAULT)


@functools.lru_cache(maxsize=1)
def _cbwr_get():
    """MKL's ``mkl_cbwr_get`` inside torch's CPU library, or None where torch has no MKL. torch
    links MKL statically and exports its service entry point under the name ``mkl_serv_cbwr_get``."""
    import torch

    if not torch.backends.mkl.is_available():
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        get = getattr(ctypes.CDLL(str(library)), "mkl_serv_cbwr_get")
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return get


def mode() -> str | None:
    """The CNR mode MKL runs in this process (``"AUTO,STRICT"``, ``"OFF"``, ``"AVX2"``...), or
    None where torch has no MKL (or does not expose it). Reading it fixes it, as MKL's first call
    would."""
    get = _cbwr_get()
    if get is None:
        return None
    value = get(-1)  # MKL_CBWR_ALL
    if value < 0:
        return f"unknown ({value})"
    name = _BRANCHES.get(value & 0xFFFF, f"branch {value & 0xFFFF}")
    return f"{name},STRICT" if value & _STRICT else name


def thread_dependence() -> str | None:
    """Why torch's GEMM may give other bits on other thread counts here (None: it may not: no
    MKL, or MKL in strict mode)."""
    current = mode()
    if current is None or current.endswith(",STRICT"):
        return None
    why = ("MKL ran before selfspec was imported, so selfspec's default could not apply: import selfspec "
           "before the first matrix product" if VARIABLE not in os.environ or os.environ[VARIABLE] == DEFAULT
           else f"the environment sets {VARIABLE}={os.environ[VARIABLE]}: unset it or set {VARIABLE}={DEFAULT}")
    return f"MKL runs in the numerical reproducibility mode {current!r}, not a strict one ({why})"
