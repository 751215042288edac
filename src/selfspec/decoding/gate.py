"""Never slower than vanilla by design: a gate that stops speculating where it does not pay.

Beyond the papers. Whether a speculative step pays depends on the machine as much as on the
method: it commits τ tokens for the cost of drafting plus a verification pass of ``k + 1`` tokens,
and on a CPU where that pass costs 1.5–2 plain steps (docs/design.md §4) a method with τ ≈ 1.5 is
slower than plain decoding, while the same method on a GPU is faster. The papers' controllers
(Draft & Verify's threshold, DEL's TPL) steer the draft *length* from acceptance alone or from a
cost model; this gate checks the outcome itself, per decoder — each step's cost either priced
from the model work it did (its cost-ledger ops, :mod:`selfspec.models.ledger`, costed with a
profile of this machine, :mod:`selfspec.measure.profile`: what ``evaluate`` does when it has a
profile) or timed on the wall clock (a gate built without a profile):

* two arms — **speculate** (the method's step) and **plain** (a step with no drafts: one
  one-token forward pass, vanilla's cost). A step that drafted nothing (e.g. the n-gram lookup
  found no match) counts as plain;
* each arm's cost per committed token is the ratio of two exponential moving averages over the
  steps it took, of a step's seconds and of its committed tokens (``smoothing``: weight of the
  newest step, below): total time over total tokens. The mean of per-step ``seconds / tokens`` would be
  biased against speculation: its steps commit 1 token or several for about the same cost, and
  the mean of the ratios over-weights the 1-token steps (steps of cost 1.3 committing 1, 1 and 3
  tokens cost 0.78 per token, while their ratios average 1.01). The two averages move at their own
  rates: a step's seconds drift with the context and are priced without noise, so they weigh the
  newest step at 0.3 (``smoothing``); its tokens are noisy (a chain of 8 drafts commits anything
  from 1 token to 9, with a spread of about 3 around 7), so they weigh it at 0.1
  (``units_smoothing``, about the last 20 steps). At 0.3 two short steps in a row (9, 3, 1 tokens
  from a chain costing 5.4 plain steps, after a run of long ones) priced speculation above plain on
  a task where it paid; at 0.1 they move its average by a fifth as much.
  Re-deciding always-speculating runs of the int8 and int4 self-drafts on SmolLM2 (12 task rows,
  bfloat16 and float32, 10 examples each; :func:`replay`), 0.1 did better than 0.3 on 7 rows (XSum
  in float32: 1.19 against 1.12 predicted), as well on 4 and 0.015 worse on one, and cost nothing
  on the papers' loops that do not pay (docs/2026-12-07-zen4.md). An arm's first steps weigh
  alike, as a mean, until 1/n falls to the weight (its first ten tokens' counts, so there the
  weight does not steady it: the probe budget's wait does);
* the gate speculates while speculation's cost is below plain's by at least ``margin`` (1%), or
  while either has not been measured yet, else it takes plain steps. A speculative step carries
  bookkeeping its ops do not price (PPD's tree layout, a drafter's Python), so a tie goes to plain:
  without the margin, arms priced alike (PPD whose trained tree is a single node on this CPU: its
  step is a plain step plus bookkeeping) swapped at every step as the context grew;
* the arm not chosen is tried again once every ``interval`` steps, so a change (another task,
  a loaded machine, a drafter that learned) is noticed. An arm not yet measured is tried at the
  second step, so a run learns both arms' costs at once instead of paying for a losing arm for
  ``min_interval`` steps first. The interval starts at ``min_interval``, doubles each time the
  probe confirms the choice, up to ``max_interval``, and falls back to ``min_interval`` when the
  choice flips. A probe lasts ``probe_steps`` steps on the probed arm (PPD's first step after
  plain steps only computes its guesses, so its probes last longer; a speculative step that
  drafted nothing is a plain step and does not end a probe of speculation);
* **a probe budget.** A probe that confirms the choice cost what its steps took beyond the
  preferred arm's cost of the same units; the next probe then waits at least long enough for
  those extra seconds to be ``probe_budget`` (1%) of the time in between, up to
  ``max_budget_interval`` steps. A cheap probe (a two-row verification of a context draft) keeps
  the doubling schedule; an expensive one (DEL drafting several tokens through exit heads, about
  2.4 plain steps beyond a plain step's cost on SmolLM2 here) is repeated every ~240 steps
  instead of 128, which halves what a method that does not pay loses to its probes. The budget
  waits for evidence: it stretches the interval only from the ``budget_after``-th (3rd) probe in a
  row that confirms the choice, so after a flip the interval doubles (8, 16, 32 steps) before the
  budget may stretch it. A chain drafter's steps commit anything from 1 token to the whole chain,
  so one or two of them say little, and a verdict from them must not keep the arm away for
  hundreds of steps: in bfloat16 on XSum the int8 self-draft's first two steps accepted 3 of 16
  drafts, the budget put the next probe past the task's end and the task decoded at 0.95 of
  vanilla's speed, while always speculating the task ran at 1.10× (τ 7.1; docs/2026-12-07-zen4.md).
  The wait counts confirming probes, not an arm's steps: the steps a chain took while preferred
  (9, 3, 1 tokens that flipped the choice) are no evidence that the probes after the flip confirm.

**In a batch** (:mod:`selfspec.models.batch`), a sequence's step is priced at what it cost the batch:
each pass it shared with other sequences' rows at its rows' share of that pass
(:meth:`~selfspec.measure.profile.Profile.op`, :attr:`~selfspec.models.ledger.LayerOp.shared`), so a
plain step riding in a wide pass is cheap, and speculation pays only where it beats that.

The gate's state is policy state: it lives on the decoder and carries over between examples (the
cost of a step is the machine's, not the example's), though not from the evaluation's warm-up
(``Decoder.kept_state``). Outputs are unaffected: a plain step is the
shared chain step with no drafts, so greedy output stays vanilla's. A gate that prices steps
from their ops is deterministic — the same run makes the same choices on any load — so it acts
under sampling too (a plain step samples from the target distribution and a speculative one keeps
it, so either way the output is lossless in distribution, and a seeded run reproduces). A gate
on the wall clock acts under greedy decoding only: under sampling its choices would make a seeded
run's tokens depend on the machine's load, so there every step speculates, as the papers do.
The evidence lands in the statistics (``plain_steps_gated``: steps the gate made plain).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from selfspec.decoding.carried import Carries
from selfspec.models.ledger import HeadOp, LayerOp, Op

@dataclass
class TwoArms(Carries):
    """Two arms, each costed as the ratio of two moving averages over the steps it took (a step's
    seconds over its units of work), the cheaper one preferred and the other probed at doubling
    intervals (the module docstring's schedule). The speculation gate's arms are speculate and
    plain, its units committed tokens; the thread policy's (:mod:`selfspec.decoding.threads`) are
    the configured thread count and one thread, its units a step's predicted seconds."""

    min_interval: int = 8
    max_interval: int = 128
    smoothing: float = 0.3
    #: the weight of the newest step in the averages of units, where it differs (None: ``smoothing``)
    units_smoothing: float | None = None
    probe_steps: int = 1
    #: the share of the time a confirming probe's extra cost may take (module docstring)
    probe_budget: float = 0.01
    max_budget_interval: int = 1024
    #: confirming probes in a row before the budget may stretch the interval (module docstring)
    budget_after: int = 3
    #: a probe's own steps replace the probed arm's averages (the thread policy: an arm's cost is
    #: the machine's load, which changes at once, so measurements from before the probe are stale)
    fresh_probes: bool = False
    #: moving averages per arm of a step's seconds and of its units (None = not measured yet)
    seconds: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    units: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    #: steps measured per arm (an arm's first steps weigh alike in its averages)
    measured: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    #: probes in a row that confirmed the choice since it last flipped (what :attr:`budget_after` counts)
    confirmed: int = field(init=False, default=0)
    _last_preferred: bool = field(init=False, default=True)
    interval: int = field(init=False)
    _since_probe: int = field(init=False, default=0)
    _probe_left: int = field(init=False, default=0)
    _probe_arm: bool = field(init=False, default=False)
    _before: bool = field(init=False, default=True)
    #: the probe under way: its seconds and units so far
    _probe_seconds: float = field(init=False, default=0.0)
    _probe_units: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not 1 <= self.min_interval <= self.max_interval:
            raise ValueError(f"need 1 <= min_interval <= max_interval, got {self.min_interval}, {self.max_interval}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.units_smoothing is not None and not 0 < self.units_smoothing <= 1:
            raise ValueError(f"units_smoothing must be in (0, 1], got {self.units_smoothing}")
        if self.probe_steps < 1:
            raise ValueError(f"probe_steps must be >= 1, got {self.probe_steps}")
        if not 0 <= self.probe_budget < 1:
            raise ValueError(f"probe_budget must be in [0, 1), got {self.probe_budget}")
        if self.budget_after < 0:
            raise ValueError(f"budget_after must be >= 0, got {self.budget_after}")
        self.interval = self.min_interval

    @property
    def cost(self) -> dict[bool, float | None]:
        """Cost per unit of each arm (None = not measured yet): the ratio of the moving averages
        (module docstring)."""
        return {arm: None if self.seconds[arm] is None else self.seconds[arm] / self.units[arm]
                for arm in (True, False)}

    @property
    def preferred(self) -> bool:
        """The arm the measurements favour (True; also while False is unmeasured)."""
        first, second = self.cost[True], self.cost[False]
        return first is None or second is None or first <= second

    @property
    def probing(self) -> bool:
        """Whether a probe of the other arm is under way."""
        return self._probe_left > 0

    def choose(self) -> bool:
        """The arm of the next step: the preferred arm, or the other one during a probe."""
        if self._probe_left:
            return self._probe_arm
        self._since_probe += 1
        preferred = self.preferred
        if preferred != self._last_preferred:  # the choice flipped (at a probe or on its arm's own steps)
            self.confirmed, self._last_preferred = 0, preferred
        unmeasured = self.seconds[preferred] is not None and self.seconds[not preferred] is None
        if self._since_probe >= (1 if unmeasured else self.interval):
            self._since_probe = 0
            self._probe_left, self._before = self.probe_steps, preferred
            self._probe_arm = not preferred
            self._probe_seconds = self._probe_units = 0.0
            return self._probe_arm
        return preferred

    def record(self, arm: bool, units: float, seconds: float) -> None:
        """One step's outcome on ``arm``: its units of work and its seconds."""
        if units > 0 and seconds > 0:
            self.measured[arm] += 1
            for average, value, smoothing in ((self.seconds, float(seconds), self.smoothing),
                                              (self.units, float(units), self.units_smoothing or self.smoothing)):
                # the first steps weigh alike (the mean of n steps) until 1/n falls to the smoothing
                weight = max(smoothing, 1 / self.measured[arm])
                old = average[arm]
                average[arm] = value if old is None else (1 - weight) * old + weight * value
        if self._probe_left and arm == self._probe_arm:
            # only a step on the probed arm counts: a speculative step that found nothing to draft
            # (an n-gram lookup without a match) cost a plain step and says nothing of speculation
            self._probe_left -= 1
            self._probe_seconds += max(float(seconds), 0.0)
            self._probe_units += max(float(units), 0.0)
            if not self._probe_left:  # the probe's verdict
                if self.fresh_probes and self._probe_units > 0:
                    arm = self._probe_arm
                    self.seconds[arm] = self._probe_seconds / self.probe_steps
                    self.units[arm] = self._probe_units / self.probe_steps
                if self.preferred != self._before:  # a flip: :meth:`choose` resets ``confirmed`` next
                    self.interval = self.min_interval
                else:
                    self.confirmed += 1
                    self.interval = max(min(self.interval * 2, self.max_interval), self._budget_interval())

    def _budget_interval(self) -> int:
        """Steps until the next probe so that the confirming probe just ended costs at most
        ``probe_budget`` of the time until then (module docstring); 0 without a budget."""
        arm = self._before
        cost, step = self.cost[arm], self.seconds[arm]
        if not self.probe_budget or cost is None or not step or self.confirmed < self.budget_after:
            return 0
        extra = self._probe_seconds - cost * self._probe_units
        return min(int(extra / (self.probe_budget * step)), self.max_budget_interval) if extra > 0 else 0


@dataclass
class SpeculationGate(TwoArms):
    """The gate of the module docstring: arm True speculates, arm False takes a plain step; a
    step's units are its committed tokens. :meth:`speculate` before a step, :meth:`record` after
    (``speculated`` = it verified at least one draft)."""

    #: a cost profile of this model (:class:`~selfspec.measure.profile.Profile`): steps are priced
    #: from their ledger ops with it instead of timed (module docstring)
    profile: Any = None
    #: the weight of the newest step in each arm's average of committed tokens (module docstring:
    #: a chain's steps commit 1 token or the whole chain)
    units_smoothing: float | None = 0.1

    @property
    def deterministic(self) -> bool:
        """Whether the gate prices steps from their ops (the same run, the same choices)."""
        return self.profile is not None

    #: how much cheaper per token speculation must be to be preferred (module docstring)
    margin: float = 0.01

    @property
    def preferred(self) -> bool:
        """Speculate (True) while either arm is unmeasured, or while speculation's cost per token
        is below plain's by at least :attr:`margin`."""
        spec, plain = self.cost[True], self.cost[False]
        return spec is None or plain is None or spec < plain * (1 - self.margin)

    def price(self, ops: "list[Op | list]", source: str | None = None, drafted: int = 0, guessed: int = 0) -> float:
        """Predicted seconds of a step from its ledger ops, its overhead included, and its own host
        work by its ``source``, ``drafted`` tokens and the ``guessed`` ones among them
        (:attr:`~selfspec.decoding.base.StepTrace`: PPD's tree, a self-drafted chain's calls per draft)."""
        return self.profile.price(ops) + self.profile.host_step(source, drafted, guessed)

    def speculate(self) -> bool:
        """Whether the next step speculates (:meth:`TwoArms.choose`)."""
        return self.choose()


def replay(trace: list[dict[str, Any]], gate: SpeculationGate) -> list[dict[str, Any]]:
    """The trace a greedy run would have had with ``gate`` (pricing with its profile) deciding each
    step, from the trace of the same run always speculating (``never_slower=false``): a projection
    onto another machine re-decides the gate there instead of replaying the choices made here.

    The always-speculating steps are taken in order while the gate speculates; a step it makes plain
    is vanilla's (one row through every layer and the head, at the context reached) and commits one
    token. That assumes a speculative step commits what the next unused one did, whatever plain
    steps came before it (acceptance depends on the text, not on which arm decoded the tokens just
    before); the tokens stop at the original trace's count. Returns the new trace (prefill first)."""
    prefill, steps = trace[0], trace[1:]
    total = sum(s.get("committed", 0) for s in steps)
    shape = gate.profile.shape
    L, vocab = shape["num_layers"], shape["vocab_size"]
    context = prefill.get("width", 1) + prefill.get("committed", 0) - 1
    out, done, i = [prefill], 0, 0
    while done < total:
        if gate.speculate() and i < len(steps):
            step, i = dict(steps[i]), i + 1
            speculated = step.get("drafted", 0) > 0 or step.get("source") == "tree"
        else:
            step = {"source": "plain", "committed": 1, "gated": True,
                    "ops": [LayerOp("plain", 1, L, L, context).row(), HeadOp("plain", 1, vocab).row()]}
            speculated = False
        step["committed"] = min(step.get("committed", 0), total - done)
        gate.record(speculated, step["committed"], gate.price(step["ops"], step["source"]))
        done += step["committed"]
        context += step["committed"]
        out.append(step)
    return out
