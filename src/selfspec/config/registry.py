"""The one registry style: a name a config gives (``method=``, ``task=``, ``job=``, a checkpoint's
``model_type``) mapped to what it names.

    METHODS = Registry("method", {"vanilla": "selfspec.decoding.vanilla:Vanilla", ...}, refusal)
    METHODS.lookup("vanilla")      # the class, its module imported on first use
    list(METHODS)                  # the names, in the registry's order: the tables' order
    METHODS.rank("medusa")         # a name's place in that order (another name: after every entry)

Each entry is ``"module:attribute"``, imported when it is first looked up, so listing the names
imports nothing. Everything an entry says about itself (a method's title, a task's score column, a
job's memory model) lives on the object it names, not in another table keyed by its name; the
registry holds the names and their order only. An unknown name is refused by :meth:`Registry.lookup`
with the registry's own message, naming the known ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class Registry(Mapping[str, Any]):
    """Names → ``"module:attribute"`` entries (module docstring). ``refusal(name, known)`` builds the
    error :meth:`lookup` raises for a name it does not hold (``known``: the names, sorted)."""

    def __init__(self, what: str, entries: Mapping[str, str],
                 refusal: Callable[[str, list[str]], Exception] | None = None) -> None:
        for name, entry in entries.items():
            if entry.count(":") != 1:
                raise ValueError(f"{what} registry: {name!r} -> {entry!r} is not 'module:attribute'")
        self.what = what
        self._entries = dict(entries)
        self._refusal = refusal or (lambda name, known: KeyError(f"unknown {what} {name!r}; one of {', '.join(known)}"))

    def __getitem__(self, name: str) -> Any:
        try:
            module, attribute = self._entries[name].split(":")
        except KeyError:
            raise KeyError(name) from None
        return getattr(importlib.import_module(module), attribute)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, name: str) -> Any:
        """What ``name`` names, or the registry's refusal naming the known names."""
        if name not in self._entries:
            raise self._refusal(name, sorted(self._entries))
        return self[name]

    def rank(self, name: str) -> int:
        """``name``'s place in the registry's order; a name it does not hold comes after every entry."""
        return list(self._entries).index(name) if name in self._entries else len(self._entries)
