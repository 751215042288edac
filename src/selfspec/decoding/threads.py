"""Threads that keep a shared machine near its fair share: per decoding step, the configured
count or one thread, whichever the step's own timings favour.

Beyond the papers. On a CPU a decoding step runs its operators on torch's OpenMP threads, which
meet at the end of every parallel region (a few hundred a step). On a quiet 2-core machine two
threads make SmolLM2-135M's one-token step at 512 context 23 ms against 35 ms on one; with one
other busy process of normal priority the two threads wait for each other at every region and
the step takes 56 ms, against 39 ms on one thread (docs/2026-11-27-cpu-results.md, "Threads under
load"). Neither count is right for both, and the load comes and goes within a run.

:class:`ThreadPolicy` chooses per step between the two arms with the speculation gate's schedule
(:class:`~selfspec.decoding.gate.TwoArms`: the cheaper arm preferred, the other probed at doubling
intervals). A step's cost is its measured seconds over its predicted seconds, its cost-ledger ops
priced with this machine's profile (:meth:`selfspec.measure.profile.Profile.price`), so steps of
every shape (a plain step, a verification pass, AdaDecode's layer-by-layer walk) compare on one
scale. While the configured count is preferred and its steps take at most ``slack`` (1.25×) what
the profile predicts, nothing suggests contention and one thread is not tried, so a quiet machine
pays no probes; past it, the schedule starts. Load comes and goes at once, so a probe judges an arm
by the probe's own steps alone (``fresh_probes``), probes come at most 64 steps apart, and the
probe budget is off: after a burst of load on a 2-core machine (a few seconds of another job) the
moving average of the configured count's slow steps had kept a run on one thread for the rest of
its task (89 of 117 steps per example of DEL on sampled CNN/DM, 0.75× vanilla), while the probe
itself measured the configured count quiet again.

Outputs do not depend on the choice. Every operator of a decoding step (passes of at most
:data:`~selfspec.models.kernels.MAX_ROWS` rows: the skinny linear, row-wise attention, the fused
norm and rotary, the head, token selection) computes each output element by the same instruction
sequence whatever the thread count; ``tests/test_threads.py`` checks every method's generation at
one and at two threads, token for token and logit for logit. The prompt's prefill runs through
a library's GEMM: oneDNN's matmul where torch has it (:func:`~selfspec.models.kernels.wide_linear`:
the policy is refused where it gives other bits on one thread than on the configured count,
:func:`~selfspec.models.kernels.wide_thread_dependence`), else MKL's, whose results depend on the thread count on some CPUs (Intel Xeons with
AVX-512) unless MKL runs in its strict reproducibility mode, which selfspec sets when it is
imported (:mod:`selfspec.numerics`). The prefill still runs at the configured count, as does
everything outside a generation (the HF peers, training). A step's pass of more than ``MAX_ROWS``
rows (PPD's larger trees) goes through the same GEMM on whichever count the step has, so under a
mode that is not strict the policy is refused (:func:`why_not_adaptive`).

Evaluate key ``threads``: ``adaptive`` (this policy; needs a profile), ``fixed`` (the configured
count throughout) or ``auto`` (adaptive on a CPU with more than one thread and a profile, else
fixed). The share of steps each arm took lands in the statistics (``steps_one_thread``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from selfspec.decoding.carried import Carries
from selfspec.decoding.gate import TwoArms
from selfspec.models.ledger import Op

#: the evaluate key's values
THREADS = ("auto", "adaptive", "fixed")


def why_not_adaptive(device: torch.device, profile) -> str | None:
    """Why ``threads=adaptive`` cannot run here (None: it can)."""
    if device.type != "cpu":
        return f"it chooses CPU threads, and the model runs on {device.type}"
    if torch.get_num_threads() < 2:
        return "torch runs one thread here, so there is nothing to choose (torch.set_num_threads)"
    if profile is None:
        return "it prices steps with this machine's cost profile, and the run has none (profile=auto)"
    from selfspec.models.kernels import wide_thread_dependence
    from selfspec.numerics import thread_dependence

    why = thread_dependence() or wide_thread_dependence(torch.get_num_threads())
    if why:
        return f"it switches thread counts mid-generation, and {why}"
    return None


@dataclass
class ThreadPolicy(Carries):
    """The module docstring's policy for one decoder: :meth:`full` before a prefill,
    :meth:`choose` before a decoding step, :meth:`record` after it."""

    profile: Any
    #: the configured thread count (torch's when the policy is built)
    threads: int = field(default_factory=torch.get_num_threads)
    arms: TwoArms = field(default_factory=lambda: TwoArms(min_interval=4, max_interval=64, probe_steps=2,
                                                          probe_budget=0.0, fresh_probes=True))
    #: measured over predicted seconds up to which the configured count shows no contention: while
    #: it is preferred and within this, one thread is not tried (a quiet machine pays no probes)
    slack: float = 1.25
    _arm: bool = field(init=False, default=True)
    _t0: float = field(init=False, default=0.0)

    def full(self) -> None:
        """The configured count (prefill, and whatever runs after a generation)."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def choose(self) -> bool:
        """Set the next step's threads (True: the configured count, False: one) and start its clock."""
        configured = self.arms.cost[True]
        quiet = self.arms.preferred and (configured is None or configured <= self.slack)
        self._arm = True if quiet and not self.arms.probing else self.arms.choose()
        want = self.threads if self._arm else 1
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        self._t0 = time.perf_counter()
        return self._arm

    def record(self, ops: "list[Op]") -> None:
        """The step just taken: its measured seconds over what its ``ops`` (a sampled step's warps
        among them) cost on the profile."""
        seconds = time.perf_counter() - self._t0
        self.arms.record(self._arm, self.profile.price(ops), seconds)
