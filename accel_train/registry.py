"""One registry per kind (datasets, models, tasks): adding a workload is registering one function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from accel_train.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, key: str) -> None:
        self.kind, self.key = kind, key
        self._entries: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def add(builder: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = builder
            return builder

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._entries:
            raise UserError(f"{self.key}: unknown {self.kind} '{name}'; choose one of {', '.join(self.names())}")
        return self._entries[name]
