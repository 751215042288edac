"""Draft-exit rules: when a self-speculative drafter stops drafting (Draft & Verify §3.4).

Shared by Draft & Verify (``method=draft_verify``: skip-set drafts), early exit and DEL
(``method=early_exit`` / ``del``: exit-layer drafts), SWIFT, KnapSpec and CLaSp, so all use one
implementation of each rule and one ``draft_stop`` sub-config:

* :class:`DraftStop` — never stop early: always draft the maximum (fixed K / fixed ``(ℓ, γ)``);
* :class:`StaticThreshold` — stop when the draft's top probability is below a fixed value
  (Draft & Verify Table 4, "static");
* :class:`AdaptiveThreshold` — Draft & Verify's adaptive threshold, Eq. 2-4, updated after every
  verification from the acceptance-rate EMA (how the EMA starts: ``ar_start``, ``ar_per_example``);
* :class:`DynamicThreshold` — DEL's per-layer threshold from shadow-token confidences (DEL §4.2).

**The sub-config is typed**, one record per rule: ``draft_stop: null`` (never stop early),
:class:`StaticStop` (``{rule: static, threshold}``), :class:`AdaptiveStop` (``{rule: adaptive,
threshold, target, epsilon, beta1, beta2, ar_start, ar_per_example}``) or, for DEL only,
:class:`DynamicStop` (``{rule: dynamic}``). Each rule's defaults are written once, in
``conf/method/draft_stop/<rule>.yaml``: a method config picks one in its defaults list
(``- draft_stop: adaptive``), the command line another with ``method/draft_stop=<rule>``, and every
key of the chosen rule must be there (none has a default in Python). :func:`draft_stop_option`
checks the sub-config once, when the method's options are read; the record builds a fresh rule
(:meth:`StopOptions.rule`, :func:`new_rule`) whenever a decoder needs one, without checking again.

One rule for every method (:mod:`selfspec.decoding.chain`): the drafted token whose confidence
(the drafter's unwarped top probability) is below the threshold is still verified.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from selfspec.config import checks
from selfspec.config.options import Options, key


class DraftStop:
    """No early stop: always draft the maximum (fixed ``(ℓ, γ)``, LayerSkip; fixed K)."""

    def threshold(self, exit_layer: int | None = None) -> float:
        return 0.0

    def start_example(self) -> None:
        """Called before every example: forget what is per example (default: nothing)."""

    def update(self, drafted: int, accepted: int, hit_max: bool) -> None:
        pass

    def state(self) -> dict[str, Any] | None:
        """The rule's state for a step trace (None: nothing that changes)."""
        return None


@dataclass
class StaticThreshold(DraftStop):
    """Stop when the draft's confidence (top probability) is below a fixed value (Draft & Verify §4.4)."""

    value: float

    def threshold(self, exit_layer: int | None = None) -> float:
        return self.value


#: ``draft_stop.ar_start`` values: how the acceptance-rate average AR starts (:class:`AdaptiveThreshold`)
AR_STARTS = ("first_rate", "zero")


@dataclass
class AdaptiveThreshold(DraftStop):
    """Draft & Verify §3.3, eqs. (2)-(4): steer the threshold θ so the acceptance rate nears ``target`` α.

    After every verification of ``drafted`` tokens, ``accepted`` of them:
    ``AR ← β1·AR + (1-β1)·accepted/drafted``; ``θ̃ = θ + ε`` while ``AR < α``, else ``θ − ε``, or ``θ``
    when drafting hit the maximum (not lowered then); ``θ ← β2·θ + (1-β2)·θ̃``. The comparison and
    the arithmetic are the authors' code's (the paper's Eq. 3 reads ``AR ≤ α``: they differ only
    when AR equals α exactly).

    How AR starts (``ar_start``): ``first_rate`` — the first round's rate (the paper's text:
    "when e is 1, β1 = 0"); ``zero`` — AR = 0 and β1 applies from the first round (the authors'
    code, where the first update therefore raises θ whenever α > 1 − β1). ``ar_per_example``: AR
    starts again at every example (:meth:`start_example`; the authors' code, where AR is local to
    one call), or it carries over with θ. θ always carries over between examples (the authors'
    evaluation passes each call's final θ to the next one).
    """

    #: its settings (the checked ``draft_stop`` sub-config): ``threshold`` is θ's start (γ0), ``target`` α
    settings: "AdaptiveStop"
    value: float = field(init=False)
    ar: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.value = self.settings.threshold
        self.ar = self._ar_start()

    def _ar_start(self) -> float | None:
        """AR before the first round: 0, or None (the first round's rate will be taken as is)."""
        return 0.0 if self.settings.ar_start == "zero" else None

    def threshold(self, exit_layer: int | None = None) -> float:
        return self.value

    def start_example(self) -> None:
        if self.settings.ar_per_example:
            self.ar = self._ar_start()

    def update(self, drafted: int, accepted: int, hit_max: bool) -> None:
        if drafted == 0:
            return
        s = self.settings
        ar_e = accepted / drafted
        self.ar = ar_e if self.ar is None else s.beta1 * self.ar + (1 - s.beta1) * ar_e
        if self.ar < s.target:
            proposal = self.value + s.epsilon
        else:
            proposal = self.value if hit_max else self.value - s.epsilon
        self.value = s.beta2 * self.value + (1 - s.beta2) * proposal

    def state(self) -> dict[str, Any]:
        return {"threshold": self.value, "ar": self.ar}


class DynamicThreshold(DraftStop):
    """DEL §4.2 (``method=del`` only): the threshold at exit layer ``ℓ`` is (mean confidence of the
    layer's matched shadow tokens + mean of its mismatched ones) / 2, read from the example's
    shadow statistics by :meth:`selfspec.decoding.early_exit.DELDrafter.plan` (0, no stop, until both
    kinds were seen)."""


#: where each rule's keys and their defaults are written
RULE_YAML = "conf/method/draft_stop/{rule}.yaml (method/draft_stop={rule})"


@dataclass(frozen=True)
class StopOptions(Options):
    """A ``draft_stop`` sub-config: its rule's keys, checked (module docstring)."""

    #: the ``rule`` key's value that selects this record
    name: ClassVar[str] = ""

    def rule(self) -> DraftStop:
        """A fresh rule with these settings (its state at the start)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """The sub-config as written: its ``rule`` and keys."""
        return {"rule": self.name, **super().config()}


@dataclass(frozen=True)
class StaticStop(StopOptions):
    """``{rule: static, threshold}`` (Draft & Verify Table 4)."""

    name = "static"
    threshold: float = key(checks.probability, why="stop drafting below this top probability")

    def rule(self) -> StaticThreshold:
        return StaticThreshold(self.threshold)


#: ``draft_stop.ar_start`` values: how the acceptance-rate average AR starts (:class:`AdaptiveThreshold`)
AR_STARTS = ("first_rate", "zero")


@dataclass(frozen=True)
class AdaptiveStop(StopOptions):
    """``{rule: adaptive, ...}``: Draft & Verify §3.3's Eq. 2-4 (:class:`AdaptiveThreshold`); its
    defaults (the paper's values, the average of its text carried over between examples) are
    ``conf/method/draft_stop/adaptive.yaml``'s."""

    name = "adaptive"
    renamed = {"initial": "threshold"}

    threshold: float = key(checks.number, 0, 1, why="γ0, where the threshold on a draft's top probability starts")
    target: float = key(checks.number, 0, 1, why="target acceptance rate α")
    epsilon: float = key(checks.number, 0, 1, low_open=True, why="threshold step ε; 0 would never adapt")
    beta1: float = key(checks.number, 0, 1, high_open=True, why="EMA factor β1 of the acceptance rate; 1 freezes it")
    beta2: float = key(checks.number, 0, 1, high_open=True, why="EMA factor β2 of the threshold; 1 freezes it")
    ar_start: str = key(checks.choice, AR_STARTS, why="the acceptance-rate average starts at the first round's rate "
                        "(the paper's text) or at 0 (the authors' code)")
    ar_per_example: bool = key(checks.flag, why="true: the average starts again at every example (the authors' code)")

    def rule(self) -> AdaptiveThreshold:
        return AdaptiveThreshold(self)


@dataclass(frozen=True)
class DynamicStop(StopOptions):
    """``{rule: dynamic}``: DEL §4.2's per-layer threshold (``method=del`` only)."""

    name = "dynamic"

    def rule(self) -> DynamicThreshold:
        return DynamicThreshold()


#: ``draft_stop.rule`` -> its record
RULES: dict[str, type[StopOptions]] = {c.name: c for c in (StaticStop, AdaptiveStop, DynamicStop)}


def draft_stop_option(name: str, value: Any, dynamic: bool = False) -> StopOptions | None:
    """A method's ``draft_stop`` key, as an option reads a key (:func:`selfspec.config.options.key`):
    null, or the record its ``rule`` names with every key of that rule checked (``dynamic``: DEL's
    rule is allowed). A missing key names the rule's YAML; a key the rule does not read, the command
    that picks another rule with its defaults."""
    if value is None:
        return None
    rules = tuple(RULES) if dynamic else ("static", "adaptive")
    if not isinstance(value, Mapping):
        raise checks.refuse(name, value, f"must be null or {{rule: ...}} with rule one of {', '.join(rules)}")
    rule = checks.choice(f"{name}.rule", value.get("rule"), rules, why="or draft_stop: null")
    record = RULES[rule]
    checks.known_keys(name, [k for k in value if k != "rule" and k not in record.renamed], record.keys(),
                      f"draft_stop with rule: {rule} (another rule with its defaults: method/draft_stop=<rule>)")
    checks.required_keys(name, value, record.keys(), RULE_YAML.format(rule=rule))
    return record.read(value, name)


def new_rule(stop: StopOptions | None) -> DraftStop:
    """A fresh rule of a checked ``draft_stop`` sub-config (:func:`draft_stop_option`); null: never stop early."""
    return DraftStop() if stop is None else stop.rule()
