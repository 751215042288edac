"""Typed method options: each method's keys as one frozen dataclass, each key's check beside it.

A method's :class:`Options` subclass lists the keys it reads from its ``method`` config. Each
field is one key:

* the annotation is the key's type;
* :func:`key` names the check of :mod:`selfspec.config.checks` it passes (with the bounds and the
  meaning the message quotes);
* its default is written in ``conf/method/<name>.yaml``, and only there: a field has none.

:meth:`Options.read` checks a config once, in field order, and returns the typed record. Rules
between keys go in :meth:`Options.validate`, or in a bound that is an earlier key's value
(:class:`Ref`). A renamed key is refused by name (:attr:`Options.renamed`), as is a key no field
reads. The messages are the checks' own, e.g. ``method.max_draft=0 is not allowed: must be >= 1
(K, the most draft tokens per step)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, NamedTuple

from selfspec.config import checks

__all__ = ["Key", "Options", "Ref", "key", "nullable"]


class Ref(NamedTuple):
    """A check's argument that is the value of an earlier key of the same options (a bound
    such as ``min_draft <= max_draft``); a ``why`` may quote earlier keys' values as ``{name}``
    and the config's prefix as ``{prefix}``."""

    name: str


@dataclasses.dataclass(frozen=True)
class Key:
    """How one key is checked: ``check(name, value, *args, **kwargs)``, one of
    :mod:`selfspec.config.checks` or a reader of a sub-config with that signature."""

    check: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def read(self, prefix: str, name: str, value: Any, earlier: Mapping[str, Any]) -> Any:
        """Check ``value``, the key ``<prefix>.<name>``, given the ``earlier`` keys' values."""
        def resolve(v):
            return earlier[v.name] if isinstance(v, Ref) else v

        kwargs = {k: resolve(v) for k, v in self.kwargs.items()}
        if "{" in kwargs.get("why", ""):
            kwargs["why"] = kwargs["why"].format(prefix=prefix, **earlier)
        return self.check(f"{prefix}.{name}", value, *(resolve(a) for a in self.args), **kwargs)


def nullable(check: Callable[..., Any]) -> Callable[..., Any]:
    """``check`` for a key whose ``null`` means the documented default:
    :func:`~selfspec.config.checks.optional` with ``check`` bound."""
    return functools.partial(checks.optional, check)


def key(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A field of an :class:`Options`: the key is checked with ``check(name, value, *args,
    **kwargs)`` (a :class:`Ref` argument is an earlier key's value)."""
    return dataclasses.field(metadata={"key": Key(check, args, kwargs)})


@dataclasses.dataclass(frozen=True)
class Options:
    """A method's checked keys (module docstring). The base has none (``method=vanilla``)."""

    #: old key -> its new key (or a sentence saying what replaced it; ``{prefix}`` is the config's
    #: own, e.g. ``method``), refused by name
    renamed: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keys, in the order they are checked."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def read(cls, cfg: Mapping[str, Any], prefix: str = "method") -> "Options":
        """``cfg``'s keys checked, each named ``<prefix>.<key>``, as the typed record (module
        docstring). A key the record does not have is not refused here: the method config also
        holds its ``name``, which :func:`selfspec.decoding.check_method` refuses the rest beside."""
        checks.renamed(prefix, cfg, {old: new.replace("{prefix}", prefix) for old, new in cls.renamed.items()})
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            values[f.name] = f.metadata["key"].read(prefix, f.name, cfg.get(f.name), values)
        options = cls(**values)
        options.validate(prefix)
        return options

    def validate(self, prefix: str) -> None:
        """Rules between keys, refused with :func:`~selfspec.config.checks.refuse` (default: none)."""

    def config(self) -> dict[str, Any]:
        """The keys and their values as plain data, a sub-config's record as its own :meth:`config`
        (what a run or an artefact records)."""
        return {name: value.config() if isinstance(value, Options) else value for name, value in self.values().items()}

    def values(self, *, without: tuple[type["Options"], ...] = ()) -> dict[str, Any]:
        """The keys and their values, less those of the option classes ``without`` (a decoder's
        parts': :class:`selfspec.decoding.base.Gated`, :class:`~selfspec.decoding.base.ContextFirst`)."""
        skip = {f.name for c in without if isinstance(self, c) for f in dataclasses.fields(c)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
