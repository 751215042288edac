"""Draft-exit rules: when a self-speculative drafter stops drafting (Draft & Verify §3.4).

Shared by Draft & Verify (``method=draft_verify``: skip-set drafts) and early exit / DEL
(``method=early_exit``: exit-layer drafts), so both use one implementation of each rule:

* :class:`DraftStop` — never stop early: always draft the maximum (fixed K / fixed ``(ℓ, γ)``);
* :class:`StaticThreshold` — stop when the draft's top probability is below a fixed value
  (Draft & Verify Table 4, "static");
* :class:`AdaptiveThreshold` — Draft & Verify's adaptive threshold, Eq. 2-4, updated after every
  verification from the acceptance-rate EMA.

The drafted token whose confidence is below the threshold is still verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class DraftStop:
    """No early stop: always draft ``γ`` tokens (fixed ``(ℓ, γ)``, LayerSkip)."""

    def threshold(self, exit_layer: int | None = None) -> float:
        return 0.0

    def update(self, drafted: int, accepted: int, hit_max: bool) -> None:
        pass


@dataclass
class StaticThreshold(DraftStop):
    """Stop when the draft's confidence (top probability) is below a fixed value (Draft & Verify §4.4)."""

    value: float

    def threshold(self, exit_layer: int | None = None) -> float:
        return self.value


@dataclass
class AdaptiveThreshold(DraftStop):
    """Draft & Verify §3.3, eqs. (2)-(4): steer the threshold so the acceptance rate nears ``target``.

    ``AR ← β1·AR + (1-β1)·AR_e`` (``β1 = 0`` at the first round), ``γ̃ = γ ± ε`` (up when
    ``AR ≤ target``), ``γ ← β2·γ + (1-β2)·γ̃``; not lowered when drafting hit the maximum
    (the authors' code). The state carries over between examples, as in their code.
    """

    initial: float = 0.6
    target: float = 0.9
    epsilon: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9
    value: float = field(init=False)
    ar: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.value = self.initial

    def threshold(self, exit_layer: int | None = None) -> float:
        return self.value

    def update(self, drafted: int, accepted: int, hit_max: bool) -> None:
        if drafted == 0:
            return
        ar_e = accepted / drafted
        self.ar = ar_e if self.ar is None else self.beta1 * self.ar + (1 - self.beta1) * ar_e
        proposal = self.value + self.epsilon if self.ar <= self.target else self.value - self.epsilon
        if hit_max and proposal < self.value:
            return
        self.value = self.beta2 * self.value + (1 - self.beta2) * proposal


def draft_stop_from_config(cfg) -> DraftStop:
    if cfg is None:
        return DraftStop()
    rule = cfg.get("rule")
    if rule == "static":
        return StaticThreshold(float(cfg["threshold"]))
    if rule == "adaptive":
        return AdaptiveThreshold(
            float(cfg.get("initial", 0.6)), float(cfg.get("target", 0.9)), float(cfg.get("epsilon", 0.01)),
            float(cfg.get("beta1", 0.5)), float(cfg.get("beta2", 0.9)),
        )
    raise ValueError(f"method.draft_stop.rule must be 'static' or 'adaptive' (or draft_stop: null), got {rule!r}")
