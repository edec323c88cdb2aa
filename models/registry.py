"""Name -> implementation registries for the pluggable parts of the GPT.

Each part of the model that can be swapped (attention, softmax, loss, quantization, activation
checkpointing, positions) has one :class:`Registry`. A choice is one entry, added with
``REGISTRY.register("name")(impl)`` (or as a decorator); the model looks choices up by name, so there
are no if-chains, and an unknown name fails with the list of valid names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry:
    """A mapping from choice names to implementations, for one config key (e.g. ``model.attention``)."""

    def __init__(self, key: str, doc: str = ""):
        self.key = key
        self.doc = doc
        self._entries: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        def add(impl: Any) -> Any:
            if name in self._entries:
                raise KeyError(f"{self.key}: {name!r} is registered twice")
            self._entries[name] = impl
            return impl

        return add

    def get(self, name: str) -> Any:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.key}={name!r}; valid names: {', '.join(self.names())}") from None

    def check(self, name: str) -> str:
        self.get(name)
        return name

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.key!r}, {self.names()})"
