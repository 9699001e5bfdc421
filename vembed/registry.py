"""A small name → class registry shared by models, losses and data sources.

Registration is by decorator in the module that defines the entry; `Registry.get` imports the package's modules
lazily so that naming an entry in a recipe is all a user needs to do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

from vembed.errors import RecipeError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a recipe name (`model_type: clip`) to the class that implements it.

    `key` is the recipe key that selects an entry, used in error messages. `modules` are imported on first lookup so
    that their `@register` decorators run; keeping them lazy keeps `import vembed` fast.
    """

    def __init__(self, key: str, modules: tuple[str, ...] = ()):
        self.key = key
        self._modules = modules
        self._entries: dict[str, T] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.key} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return decorator

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._modules:
                importlib.import_module(module)

    def get(self, name: str) -> T:
        self._load()
        if name not in self._entries:
            hint = did_you_mean(name, self._entries) or f" (choose one of: {', '.join(sorted(self._entries))})"
            raise RecipeError(self.key, f"unknown {self.key} {name!r}{hint}")
        return self._entries[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries
