"""Parameter objects that reject unknown fields: a typo in a profile or calibration file is an
error, never a silently ignored setting."""

from __future__ import annotations

import dataclasses
from typing import Any, Self


class StrictParams:
    """Mixin for frozen dataclasses: from_dict refuses unknown and missing-required fields and
    runs check_valid(); to_dict is its inverse."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "") -> Self:
        if not isinstance(data, dict):
            raise ValueError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where or cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
        try:
            obj = cls(**data)  # type: ignore[call-arg]
        except TypeError as err:
            raise ValueError(f"{where or cls.__name__}: {err}") from None
        obj.check_valid()
        return obj

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def replace(self, **changes: Any) -> Self:
        obj = self.from_dict({**self.to_dict(), **changes}, where=type(self).__name__)
        return obj

    def check_valid(self) -> None:
        """Subclasses raise ValueError on out-of-range values."""


def require_positive(obj: object, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        ok = value >= 0 if allow_zero else value > 0
        if not isinstance(value, int | float) or isinstance(value, bool) or not ok:
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{type(obj).__name__}.{name} must be a number {bound}, got {value!r}")
