"""Draft-exit rules: when a self-speculative drafter stops drafting (Draft & Verify §3.4).

Shared by Draft & Verify (``method=draft_verify``: skip-set drafts), early exit and DEL
(``method=early_exit`` / ``del``: exit-layer drafts), so all use one implementation of each rule
and one ``draft_stop`` sub-config (:func:`draft_stop_from_config`):

* :class:`DraftStop` — never stop early: always draft the maximum (fixed K / fixed ``(ℓ, γ)``);
* :class:`StaticThreshold` — stop when the draft's top probability is below a fixed value
  (Draft & Verify Table 4, "static");
* :class:`AdaptiveThreshold` — Draft & Verify's adaptive threshold, Eq. 2-4, updated after every
  verification from the acceptance-rate EMA (how the EMA starts: ``ar_start``, ``ar_per_example``);
* :class:`DynamicThreshold` — DEL's per-layer threshold from shadow-token confidences (DEL §4.2).

One rule for every method (:mod:`selfspec.decoding.chain`): the drafted token whose confidence
(the drafter's unwarped top probability) is below the threshold is still verified.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from selfspec.config import checks


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

    initial: float = 0.6
    target: float = 0.9
    epsilon: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9
    ar_start: str = "first_rate"
    ar_per_example: bool = False
    value: float = field(init=False)
    ar: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.value = self.initial
        self.ar = self._ar_start()

    def _ar_start(self) -> float | None:
        """AR before the first round: 0, or None (the first round's rate will be taken as is)."""
        return 0.0 if self.ar_start == "zero" else None

    def threshold(self, exit_layer: int | None = None) -> float:
        return self.value

    def start_example(self) -> None:
        if self.ar_per_example:
            self.ar = self._ar_start()

    def update(self, drafted: int, accepted: int, hit_max: bool) -> None:
        if drafted == 0:
            return
        ar_e = accepted / drafted
        self.ar = ar_e if self.ar is None else self.beta1 * self.ar + (1 - self.beta1) * ar_e
        if self.ar < self.target:
            proposal = self.value + self.epsilon
        else:
            proposal = self.value if hit_max else self.value - self.epsilon
        self.value = self.beta2 * self.value + (1 - self.beta2) * proposal

    def state(self) -> dict[str, Any]:
        return {"threshold": self.value, "ar": self.ar}


class DynamicThreshold(DraftStop):
    """DEL §4.2 (``method=del`` only): the threshold at exit layer ``ℓ`` is (mean confidence of the
    layer's matched shadow tokens + mean of its mismatched ones) / 2, read from the example's
    shadow statistics by :meth:`selfspec.decoding.early_exit.DELDrafter.plan` (0, no stop, until both
    kinds were seen)."""


#: ``draft_stop`` key of the adaptive rule -> :class:`AdaptiveThreshold` parameter: ``threshold`` is the
#: threshold, as under ``rule: static``; the adaptive rule starts there (Draft & Verify's γ0)
ADAPTIVE_KEYS = {"threshold": "initial", "target": "target", "epsilon": "epsilon", "beta1": "beta1", "beta2": "beta2"}
#: allowed range and meaning of each :class:`AdaptiveThreshold` parameter (Draft & Verify §3.3)
ADAPTIVE_RANGES: dict[str, tuple[dict[str, Any], str]] = {
    "initial": ({"low": 0, "high": 1}, "initial threshold on a draft's top probability"),
    "target": ({"low": 0, "high": 1}, "target acceptance rate"),
    "epsilon": ({"low": 0, "high": 1, "low_open": True}, "threshold step; 0 would never adapt"),
    "beta1": ({"low": 0, "high": 1, "high_open": True}, "EMA factor of the acceptance rate; 1 freezes it"),
    "beta2": ({"low": 0, "high": 1, "high_open": True}, "EMA factor of the threshold; 1 freezes it"),
}
ADAPTIVE_DEFAULTS = {f.name: f.default for f in fields(AdaptiveThreshold) if f.init}
#: ``draft_stop`` keys of the adaptive rule that say how its acceptance-rate average starts (:class:`AdaptiveThreshold`)
AR_KEYS = ("ar_start", "ar_per_example")


def adaptive_parameters(named: dict[str, tuple[str, Any]]) -> dict[str, float]:
    """``{parameter: (config key, value)}`` -> checked :class:`AdaptiveThreshold` keyword arguments."""
    return {param: checks.number(key, value, **ADAPTIVE_RANGES[param][0], why=ADAPTIVE_RANGES[param][1])
            for param, (key, value) in named.items()}


def draft_stop_from_config(cfg, prefix: str = "method.draft_stop", dynamic: bool = False) -> DraftStop:
    """The rule a ``draft_stop`` config names, every value checked: null (never stop early),
    ``{rule: static, threshold}``, ``{rule: adaptive, threshold, target, epsilon, beta1, beta2,
    ar_start, ar_per_example}`` (``threshold`` is where the adaptive rule starts; the others
    default to :data:`ADAPTIVE_DEFAULTS`: Draft & Verify's values, and the average of the paper's
    text carried over between examples) or, where ``dynamic`` (DEL), ``{rule: dynamic}``
    (:class:`DynamicThreshold`)."""
    if cfg is None:
        return DraftStop()
    rules = ("static", "adaptive", "dynamic") if dynamic else ("static", "adaptive")
    if not isinstance(cfg, Mapping):
        raise checks.refuse(prefix, cfg, f"must be null or {{rule: ...}} with rule one of {', '.join(rules)}")
    rule = checks.choice(f"{prefix}.rule", cfg.get("rule"), rules, why="or draft_stop: null")
    if rule == "dynamic":
        checks.known_keys(prefix, cfg, ("rule",), "draft_stop with rule: dynamic")
        return DynamicThreshold()
    if rule == "static":
        checks.known_keys(prefix, cfg, ("rule", "threshold"), "draft_stop with rule: static")
        return StaticThreshold(checks.probability(f"{prefix}.threshold", cfg.get("threshold"),
                                                  why="stop drafting below this top probability"))
    checks.renamed(prefix, cfg, {"initial": "threshold"})
    checks.known_keys(prefix, cfg, ("rule", *ADAPTIVE_KEYS, *AR_KEYS), "draft_stop with rule: adaptive")
    return AdaptiveThreshold(**adaptive_parameters(
        {param: (f"{prefix}.{k}", _value(cfg.get(k), ADAPTIVE_DEFAULTS[param])) for k, param in ADAPTIVE_KEYS.items()}),
        **ar_options(cfg, prefix))


def ar_options(cfg, prefix: str) -> dict[str, Any]:
    """The adaptive rule's :data:`AR_KEYS`, checked (unset: :data:`ADAPTIVE_DEFAULTS`)."""
    return {
        "ar_start": checks.choice(f"{prefix}.ar_start", _value(cfg.get("ar_start"), ADAPTIVE_DEFAULTS["ar_start"]),
                                  AR_STARTS, why="the acceptance-rate average starts at the first round's rate "
                                  "(the paper's text) or at 0 (the authors' code)"),
        "ar_per_example": checks.flag(f"{prefix}.ar_per_example",
                                      _value(cfg.get("ar_per_example"), ADAPTIVE_DEFAULTS["ar_per_example"]),
                                      why="true: the average starts again at every example (the authors' code)"),
    }


def draft_stop_config(cfg, prefix: str = "method.draft_stop", dynamic: bool = False) -> dict | None:
    """A ``draft_stop`` config checked (:func:`draft_stop_from_config`) and returned as plain data
    (JSON-able: run records, artefact metadata); build the rule from it with
    :func:`draft_stop_from_config`."""
    draft_stop_from_config(cfg, prefix, dynamic)
    if cfg is None:
        return None
    return {str(k): v for k, v in (cfg.items() if hasattr(cfg, "items") else ())}


def draft_stop_option(name: str, value, dynamic: bool = False) -> dict | None:
    """A method's ``draft_stop`` key (:func:`draft_stop_config`), as an option reads a key
    (:func:`selfspec.config.options.key`): the rule's config, checked, as plain data."""
    return draft_stop_config(value, name, dynamic)


def _value(value, default):
    return default if value is None else value
