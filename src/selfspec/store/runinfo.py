"""What every run records so it can be trusted: git commit, library versions, hardware, seed."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    root = Path(__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def hardware(kernel_paths: dict[str, str] | None) -> dict[str, Any]:
    """The machine: platform, CPU (its model name, family and model numbers (:func:`cpu_id`) and the
    instruction set torch's kernels use),
    threads, MKL's reproducibility mode (:mod:`selfspec.numerics`: on some CPUs the bits of torch's
    GEMM depend on the thread count unless it is strict), the paths the runtime's CPU kernels take
    (``kernel_paths``, the caller's :func:`selfspec.models.kernels.paths`: in bfloat16 each gives its
    own bits; the store lies below the models, so they are handed in) and the GPU."""
    from selfspec.numerics import mode

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_threads": torch.get_num_threads(),
        "mkl_cbwr": mode(),
        "kernel_paths": kernel_paths,
        **cpu_id(),  # the CPU's family and model: Zen 4 and Zen 5 share a name and flags
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    return info


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("selfspec", "torch", "transformers", "accelerate", "datasets", "hydra-core", "wandb"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def run_info(seed: int | None = None, device: str | None = None, dtype: str | None = None,
             linear_kernel: str | None = None, capture: str | None = None, *,
             kernel_paths: dict[str, str] | None) -> dict[str, Any]:
    """What a result needs to be trusted: commit, library versions, hardware (with ``kernel_paths``,
    the caller's :func:`selfspec.models.kernels.paths`: :func:`hardware`), seed, device, dtype,
    the runtime's linear kernel (``skinny`` or ``torch``: their outputs differ in the last bits) and
    its capture mode (``graphs``, ``static`` or ``off``: static passes attend over the whole buffer)."""
    info = {"git_commit": git_commit(), "versions": versions(), "hardware": hardware(kernel_paths)}
    if linear_kernel is not None:
        info["linear_kernel"] = linear_kernel
    if capture is not None:
        info["capture"] = capture
    if seed is not None:
        info["seed"] = seed
    if device is not None:
        info["device"] = device
    if dtype is not None:
        info["dtype"] = dtype
    return info


def cpu_id() -> dict[str, Any]:
    """The CPU's vendor family and model numbers and whether it has AVX-512F, from ``/proc/cpuinfo``
    (its first processor's ``cpu family``, ``model`` and ``flags``): ``cpu_family``, ``cpu_model``,
    ``cpu_avx512``. A model name does not tell a CPU's generation (a VM's "AMD EPYC" is a Zen 3, 4 or
    5, and each costs its own); these do. Empty where the file is absent (not Linux) or says no
    family (an ARM CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():  # the first processor's entry ends here
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    try:
        return {"cpu_family": int(fields["cpu family"]), "cpu_model": int(fields["model"]),
                "cpu_avx512": "avx512f" in fields.get("flags", "").split()}
    except (KeyError, ValueError):
        return {}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
