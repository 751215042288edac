"""Checks of config values, shared by every place that reads a config key.

Each reader checks the keys it reads, where it reads them (a decoder's ``options``, a job's
``check``, a task's options, ``Sampling``), with these helpers; nothing here knows the configs.
A bad value stops with one :class:`ConfigError` naming the key as a Hydra override, the value
and what is allowed, e.g. ``method.threshold=1.5 is not allowed: must be in [0, 1) (...)``. Values
are never clamped or replaced: ``null`` means "the documented default" only where a config says
so, and an integral float (``2.0``) is read as the integer it is, but ``1.5`` is not an integer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Callable, TypeVar

T = TypeVar("T")

__all__ = ["ConfigError", "choice", "flag", "integer", "integers", "known_keys", "listed", "number",
           "optional", "probability", "refuse", "text"]


class ConfigError(ValueError):
    """An impossible config value; the message names the key, the value and what is allowed."""


def show(value: Any) -> str:
    """A value as it is written in a Hydra override (``true``, ``null``, ``[1, 2]``, ``abc``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def refuse(key: str, value: Any, rule: str, why: str = "") -> ConfigError:
    """The error for ``key=value``: ``rule`` says what is allowed, ``why`` what the key means."""
    return ConfigError(f"{key}={show(value)} is not allowed: {rule}" + (f" ({why})" if why else ""))


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"must be {'>' if low_open else '>='} {low}"
    return f"must be {'<' if high_open else '<='} {high}"


def number(key: str, value: Any, low: float | None = None, high: float | None = None, *,
           low_open: bool = False, high_open: bool = False, why: str = "") -> float:
    """``value`` as a finite float within the interval (``None`` bound = unbounded). NaN and the
    infinities never pass: no setting means them, and JSON, where every run records its config,
    cannot hold them (an infinite temperature was recorded as ``null``, read back as greedy)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse(key, value, "must be a number", why)
    v = float(value)
    if not math.isfinite(v):
        interval = _interval(low, high, low_open, high_open).removeprefix("must be ")
        raise refuse(key, value, "must be a finite number" + (f" {interval}" if (low, high) != (None, None) else ""),
                     why)
    ok = (low is None or (v > low if low_open else v >= low)) and (high is None or (v < high if high_open else v <= high))
    if not ok:
        raise refuse(key, value, _interval(low, high, low_open, high_open) if (low, high) != (None, None)
                     else "must be a finite number", why)
    return v


#: the seeds torch's generators take (``torch.manual_seed``: a 64-bit integer, signed or not)
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


def seed(key: str, value: Any) -> int:
    """A random seed: an integer torch's generators take (:data:`SEED_RANGE`), checked before a model
    loads (a seed beyond 64 bits failed raw in ``torch.manual_seed``, after the model had loaded)."""
    return integer(key, value, *SEED_RANGE, why="a seed of torch's generators: a 64-bit integer")


def probability(key: str, value: Any, *, low_open: bool = False, high_open: bool = False,
                why: str = "") -> float:
    """A probability (or threshold on one): a number in [0, 1], ends open as asked."""
    return number(key, value, 0, 1, low_open=low_open, high_open=high_open, why=why)


def integer(key: str, value: Any, low: int | None = None, high: int | None = None, *, why: str = "") -> int:
    """``value`` as an int in ``[low, high]``; ``2.0`` is 2, ``1.5`` and ``true`` are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not value.is_integer()):
        raise refuse(key, value, "must be an integer", why)
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        raise refuse(key, value, _interval(low, high, False, False), why)
    return v


def listed(check: Callable[..., T], key: str, value: Any, *args: Any, **kwargs: Any) -> list[T]:
    """A list whose items each pass ``check`` (named ``key[i]``)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise refuse(key, value, "must be a list, e.g. [1, 2]", kwargs.get("why", ""))
    return [check(f"{key}[{i}]", v, *args, **kwargs) for i, v in enumerate(value)]


def integers(key: str, value: Any, low: int | None = 0, *, distinct: bool = False, why: str = "") -> list[int]:
    """A list of integers ``>= low`` (layer indices: ``low=0``), optionally all different."""
    out = listed(integer, key, value, low, why=why)
    if distinct and len(set(out)) != len(out):
        raise refuse(key, value, "must not repeat a value", why)
    return out


def choice(key: str, value: Any, choices: Iterable[Any], why: str = "") -> Any:
    """``value`` if it is one of ``choices``."""
    choices = list(choices)
    if not any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in choices):
        raise refuse(key, value, "must be one of " + ", ".join(show(c) for c in choices), why)
    return value


def flag(key: str, value: Any, why: str = "") -> bool:
    """A boolean; the strings ``"yes"`` / ``"false"`` and numbers are refused (not guessed)."""
    if not isinstance(value, bool):
        raise refuse(key, value, "must be true or false", why)
    return value


def text(key: str, value: Any, why: str = "") -> str:
    """A non-empty string (a name, a path)."""
    if not isinstance(value, str) or not value.strip():
        raise refuse(key, value, "must be a non-empty string", why)
    return value


def optional(check: Callable[..., T], key: str, value: Any, *args: Any, **kwargs: Any) -> T | None:
    """``None`` for ``null``, else ``check(key, value, ...)``."""
    return None if value is None else check(key, value, *args, **kwargs)


def known_keys(prefix: str, cfg: Mapping[str, Any], keys: Iterable[str], what: str) -> None:
    """Refuse keys of ``cfg`` that its reader does not read (a typo would otherwise be ignored);
    ``prefix`` "" names top-level keys."""
    keys = set(keys)
    unknown = sorted(str(k) for k in cfg if k not in keys)
    if unknown:
        raise ConfigError(f"{prefix + '.' if prefix else ''}{unknown[0]} is not a key of {what}; its keys are "
                          f"{', '.join(sorted(keys))}")


def required_keys(prefix: str, cfg: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    """Refuse a config that lacks keys its reader reads: their defaults live in the YAML under
    ``conf/`` (``where``), never in the Python that reads them."""
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ConfigError(f"{prefix} config lacks {', '.join(f'{prefix}.{k}' for k in missing)}; "
                          f"start from {where}, which sets every key")


def renamed(prefix: str, cfg: Mapping[str, Any], renames: Mapping[str, str]) -> None:
    """Refuse a key a config reader no longer reads under that name, naming its new key
    (``renames``: old key -> new key, or a sentence saying what replaced it)."""
    for old, new in renames.items():
        if old in cfg:
            new = new if " " in new else f"{prefix}.{new}"
            raise ConfigError(f"{prefix}.{old} was renamed: set {new} instead "
                              f"(found {prefix}.{old}={show(cfg[old])})")
