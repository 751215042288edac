"""A method's cost breakdown, as the report shows it (issue 23): where a committed token's time goes,
in vanilla steps, from the cost ledger a generation keeps (:mod:`selfspec.models.ledger`, which
records it), and whether the run that measured it was spoiled by other load on the machine.

A method's entry in an evaluation's ``summary.json`` carries (HF peers: None)::

    "predicted_speedup": 1.05,
    "ledger": {"unit": "vanilla steps per committed token",
               "measured":  {"prefill": .., "plain": .., "draft": .., "heads": .., "verify": .., "tree": .., "search": .., "host": ..},
               "predicted": {... the same keys ...} | None}

``measured``: each component's seconds per committed token ÷ vanilla's seconds per committed token
in the same run, so the components sum to ``1 / speedup``; ``predicted``: the same costed from the
step trace with a machine profile (sum ``1 / predicted_speedup``). A component left out is 0. The
run's ``summary["contention"]`` (``ratio``, ``threshold``, ``flagged``) says whether the baseline's
model passes took much longer than predicted: other work on the machine slowed the run, and its
speedups are shown marked as measured under load (:data:`LOADED`), never as clean figures.

    parts(record.ledger["measured"])        # {"verify": 1.0, "heads": 0.26, ...}: every component, 0 when left out
    in_words("AdaDecode", 1.21, ledger)    # "AdaDecode 0.72× = τ 1.21 / 1.68 steps (verification 1.00, ...)"

The demo's closing lines, one sentence per method, are :func:`selfspec.reporting.tables.ledger_lines`
(they follow the tables' row order).
"""

from __future__ import annotations

from typing import Any

from selfspec.models.ledger import COMPONENTS  # the ledger's components, in drawing order
from selfspec.models.ledger import LABELS as LABEL  # what each is called in the charts and the demo's words

#: one colour per component, the same in every chart (Okabe–Ito: told apart with colour blindness)
COLOUR = {"prefill": "#CC79A7", "plain": "#56B4E9", "draft": "#E69F00", "heads": "#F0E442",
          "verify": "#0072B2", "tree": "#009E73", "search": "#D55E00", "host": "#999999"}
#: the colour of a component the format does not name (a newer runtime's)
OTHER_COLOUR = "#444444"
#: the ledger's unit, as its ``unit`` field says it
UNIT = "vanilla steps per committed token"
#: the mark of a speedup measured under load (``summary["contention"]["flagged"]``)
LOADED = "(loaded)"


def parts(part: dict[str, Any] | None) -> dict[str, float]:
    """Every component of one side of a ledger (``measured`` or ``predicted``), 0.0 where it was left
    out, in :data:`COMPONENTS` order; components the format does not name follow, so the sum stays
    the side's whole cost."""
    part = part or {}
    out = {c: float(part.get(c) or 0.0) for c in COMPONENTS}
    out.update({str(k): float(v or 0.0) for k, v in part.items() if k not in COMPONENTS})
    return out


def cost(part: dict[str, Any] | None) -> float:
    """The side's cost per committed token in vanilla steps: ``1 / speedup`` (measured) or
    ``1 / predicted_speedup`` (predicted)."""
    return sum(parts(part).values())


def label(component: str) -> str:
    return LABEL.get(component, component)


def colour(component: str) -> str:
    return COLOUR.get(component, OTHER_COLOUR)


def in_words(title: str, tau: float | None, ledger: dict[str, Any], predicted_speedup: float | None = None,
             loaded: bool = False) -> str:
    """One method's ledger as a sentence: its speedup as τ tokens per step over the step's cost.

    With ``c`` = the measured cost per committed token (vanilla steps), ``speedup = 1 / c = τ / (τ·c)``:
    a step commits τ tokens and costs ``τ·c`` vanilla steps, split into the components (each × τ),
    largest first; those that would print as 0.00 are left out::

        AdaDecode 0.72× = τ 1.21 / 1.68 steps (verification 1.00, exit heads 0.31, ...); predicted 0.80×

    Without τ the sentence is per token (``1 / c``). ``loaded``: the run was measured under load, and
    the speedup says so (:data:`LOADED`).
    """
    measured = parts(ledger.get("measured"))
    c = sum(measured.values())
    has_tau = isinstance(tau, (int, float)) and tau > 0
    per = float(tau) if has_tau else 1.0
    steps = sorted(((v * per, k) for k, v in measured.items()), key=lambda t: -t[0])
    spent = ", ".join(f"{label(k)} {v:.2f}" for v, k in steps if round(v, 2) != 0)
    speed = f"{1 / c:.2f}×" if c > 0 else "–"
    if loaded:
        speed += f" {LOADED}"
    head = f"τ {per:.2f} / {per * c:.2f} steps" if has_tau else f"1 / {c:.2f} steps per token"
    line = f"{title} {speed} = {head} ({spent})"
    if isinstance(predicted_speedup, (int, float)):
        line += f"; predicted {predicted_speedup:.2f}×"
    elif ledger.get("unpriced"):
        line += f"; not predicted: {ledger['unpriced']}"
    return line


def is_loaded(contention: dict[str, Any] | None) -> bool:
    """Whether a run's ``summary["contention"]`` flags its timings as spoiled by other load."""
    return bool((contention or {}).get("flagged"))


def contention_warning(contention: dict[str, Any] | None, where: str) -> str | None:
    """The warning a flagged run's section shows (None when the run is not flagged)."""
    if not is_loaded(contention):
        return None
    ratio, threshold = contention.get("ratio"), contention.get("threshold")
    spoiled = contention.get("spoiled") or []
    if (isinstance(ratio, (int, float)) and isinstance(threshold, (int, float)) and ratio <= threshold
            and spoiled):
        worst = max(spoiled, key=lambda g: g["excess"])
        how = (f"{len(spoiled)} generation{'s' * (len(spoiled) != 1)} took more than their method's usual time "
               f"for their steps (the worst, {worst['method']} on {worst['id']}, {worst['excess']:.2f}×)")
    elif isinstance(ratio, (int, float)) and isinstance(threshold, (int, float)):
        how = f"vanilla's model passes took {ratio:.2f}× their predicted time (threshold {threshold:.2f}×)"
    else:
        how = "vanilla's model passes took longer than predicted"
    return (f"Measured under load — {where}: {how}, so other work on the machine slowed this run. Its "
            f"speedups are marked {LOADED} and are not clean figures; re-run on an idle machine.")
