"""DEL's controller (COLM 2025, §4) on the LayerSkip loop of :mod:`reference.layerskip`.

Sources. DEL's code (hoenza/DEL) builds on LayerSkip's loop; it could not be read from this
machine, so this reference is written from the facts recorded from it (docs/design/reproduction.md §6) and
the paper, and takes selfspec's choice where neither fixes a detail (each marked *assumed* here
and listed in docs/design/fidelity.md). What it does:

* **shadow tokens** (recorded): after each verification, the final norm + LM head on every
  candidate layer's state of the verified rows whose context was right (the round's input and
  the accepted drafts; layers ``<= ℓ`` from drafting, the rest from verification) gives each
  layer's token and confidence (top probability), compared with the token the final layer
  produced there;
* **decayed statistics** (ω recorded; their form assumed): per layer, sums decayed by ``ω``
  per observation, in row order, of observations, matches, mismatches and the confidences of
  matched and of mismatched shadow tokens; ``α_ℓ`` = matches / observations;
* **plan** (recorded): ``(ℓ, γ) = argmax TPL``, ``TPL = Σ_{i=0}^{γ} α_ℓ^i / (γ·(ℓ+1) + L - ℓ - 1)``
  over the candidate layers and ``γ`` in ``min_draft..max_draft`` (``max_draft`` 18 recorded;
  ``min_draft`` 1 and the first maximum on ties assumed);
* **draft stop** (recorded): ``τ_ℓ = (mean confidence of matched + mean confidence of
  mismatched) / 2``; drafting stops after a draft whose confidence is below it, and that draft
  is verified (assumed); no stop until layer ``ℓ`` has seen both kinds (assumed);
* **first step** (assumed): the prompt runs every layer and commits its argmax, and the shadow
  tokens of its last ``prefill_shadow`` rows, compared with the final layer's argmax there, seed
  the statistics (selfspec's prefill; the authors' initial controller state is not recorded).
"""

from __future__ import annotations

from typing import Any

import torch

from reference.layerskip import LayerSkip, Plan


class ShadowEMA:
    """Per-layer statistics of shadow tokens, one observation at a time (module docstring)."""

    def __init__(self, n_layers: int, omega: float) -> None:
        self.omega = omega
        self.weight = [0.0] * n_layers
        self.match = [0.0] * n_layers
        self.miss = [0.0] * n_layers
        self.conf_match = [0.0] * n_layers
        self.conf_miss = [0.0] * n_layers
        self.seen_match = [0] * n_layers
        self.seen_miss = [0] * n_layers

    def observe(self, layer: int, matched: bool, conf: float) -> None:
        w = self.omega
        self.weight[layer] = w * self.weight[layer] + 1.0
        self.match[layer] = w * self.match[layer] + float(matched)
        self.miss[layer] = w * self.miss[layer] + float(not matched)
        self.conf_match[layer] = w * self.conf_match[layer] + (conf if matched else 0.0)
        self.conf_miss[layer] = w * self.conf_miss[layer] + (0.0 if matched else conf)
        self.seen_match[layer] += matched
        self.seen_miss[layer] += not matched

    def alpha(self, layer: int) -> float:
        return self.match[layer] / self.weight[layer] if self.weight[layer] else 0.0

    def mean_conf(self, layer: int) -> tuple[float | None, float | None]:
        """Mean confidence of the layer's matched and of its mismatched shadow tokens (None: none yet)."""
        matched = self.conf_match[layer] / self.match[layer] if self.seen_match[layer] else None
        missed = self.conf_miss[layer] / self.miss[layer] if self.seen_miss[layer] else None
        return matched, missed

    def tau(self, layer: int) -> float:
        """DEL §4.2's stop threshold τ_ℓ (0 until both kinds were seen)."""
        matched, missed = self.mean_conf(layer)
        return 0.0 if matched is None or missed is None else (matched + missed) / 2

    def state(self) -> dict[str, list]:
        means = [self.mean_conf(c) for c in range(len(self.weight))]
        return {"alpha": [self.alpha(c) for c in range(len(self.weight))],
                "conf_match": [m for m, _ in means], "conf_miss": [x for _, x in means]}


def tpl_plan(alpha: list[float], layers: list[int], gammas: range, num_layers: int) -> tuple[int, int]:
    """DEL §4.1 with the authors' denominator: the first ``(ℓ, γ)`` (layers, then lengths, in
    increasing order) of greatest ``Σ_{i=0}^{γ} α^i / (γ·(ℓ+1) + L - ℓ - 1)``."""
    best, choice = None, None
    for a, ell in zip(alpha, layers):
        for gamma in gammas:
            tokens = sum(a**i for i in range(gamma + 1))
            tpl = tokens / (gamma * (ell + 1) + num_layers - ell - 1)
            if best is None or tpl > best:
                best, choice = tpl, (ell, gamma)
    return choice


class DEL(LayerSkip):
    """DEL on LayerSkip's loop (module docstring); candidate exit layers ``0..L-2``."""

    def __init__(self, hf, max_draft: int = 18, min_draft: int = 1, omega: float = 0.95, prefill_shadow: int = 8,
                 eos_token_ids=()) -> None:
        super().__init__(hf, 0, max_draft, eos_token_ids, first_round="prefill")
        self.layers = list(range(self.m.num_layers - 1))
        self.gammas = range(int(min_draft), int(max_draft) + 1)
        self.stats = ShadowEMA(len(self.layers), omega)
        self.prefill_shadow = int(prefill_shadow)
        self.current: Plan | None = None

    def plan(self) -> Plan:
        ell, gamma = tpl_plan([self.stats.alpha(c) for c in range(len(self.layers))], self.layers, self.gammas,
                              self.m.num_layers)
        self.current = Plan(ell, gamma, self.stats.tau(self.layers.index(ell)))
        return self.current

    def keep(self) -> tuple[int, ...]:
        return tuple(self.layers)

    def observe(self, kept: dict[int, torch.Tensor], committed: list[int]) -> None:
        """Shadow tokens of the verified rows, row by row, every candidate layer."""
        shadow = {i: self.m.logits(kept[i][0]).softmax(-1).max(-1) for i in self.layers}
        for row, token in enumerate(committed):
            for c, i in enumerate(self.layers):
                conf, tok = shadow[i]
                self.stats.observe(c, int(tok[row]) == token, float(conf[row]))

    def controller(self) -> dict[str, Any]:
        """The round's plan and the statistics after it (selfspec's DEL step trace)."""
        plan = self.current
        head = {} if plan is None else {"exit_layer": plan.exit_layer, "max_draft": plan.gamma,
                                        "threshold": plan.threshold}
        return {**head, **self.stats.state()}

    def prefill(self, prompt: list[int], cache) -> int:
        """The prompt through every layer; the shadow tokens of its last rows seed the statistics."""
        keep = {i: [] for i in self.layers}
        h = self.m.run(self.m.embed(prompt), range(self.m.num_layers), cache, keep)
        rows = min(self.prefill_shadow, len(prompt))
        final = self.m.logits(h[:, -rows:])[0].argmax(-1).tolist()
        self.observe({i: s[0][:, -rows:] for i, s in keep.items()}, final)
        return final[-1]
