"""Parameter objects that reject unknown fields: a typo in a profile or calibration file is an
error, never a silently ignored setting."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
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


def json_difference(fresh, committed, rel: float = 1e-9, path: str = "$") -> str | None:
    """Where two parsed JSON documents differ, or None: every key, length and non-float value equal, floats to
    `rel` relative (a least-squares fit's last digits follow the BLAS and numpy build, not the records). The
    `--check` of the fit scripts, which compared the text byte for byte."""
    if isinstance(fresh, float) or isinstance(committed, float):
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (fresh, committed))
        if numbers and math.isclose(fresh, committed, rel_tol=rel, abs_tol=1e-15):
            return None
        return f"{path}: {committed!r} committed, {fresh!r} fresh"
    if isinstance(committed, dict):
        if not isinstance(fresh, dict) or fresh.keys() != committed.keys():
            keys = sorted(set(fresh) ^ set(committed)) if isinstance(fresh, dict) else "not an object"
            return f"{path}: keys differ ({keys})"
        return next((d for k in committed if (d := json_difference(fresh[k], committed[k], rel, f"{path}.{k}"))),
                    None)
    if isinstance(committed, list):
        if not isinstance(fresh, list) or len(fresh) != len(committed):
            return f"{path}: lengths differ"
        return next((d for i, (a, b) in enumerate(zip(fresh, committed, strict=True))
                     if (d := json_difference(a, b, rel, f"{path}[{i}]"))), None)
    return None if fresh == committed and type(fresh) is type(committed) else (
        f"{path}: {committed!r} committed, {fresh!r} fresh")



def check_written(text: str, path: Path) -> int:
    """A fit script's --check: 0 when `path` holds what `text` (a fresh build's JSON) says, to json_difference's
    tolerance, else 1; prints which, and where they differ."""
    where = json_difference(json.loads(text), json.loads(path.read_text())) if path.is_file() else "no such file"
    print(f"{path}: up to date" if where is None else f"{path} differs from a fresh fit: {where}")
    return 0 if where is None else 1


def write_or_check(profile: dict, path: Path, check: bool) -> int:
    """A fit script's last step: with check, check_written (floats to 1e-9: last digits follow the BLAS build);
    else write the profile's JSON to `path`. Returns the exit code."""
    text = json.dumps(profile, indent=2) + "\n"
    if check:
        return check_written(text, path)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


def run_fit(build: Callable[[], dict], print_table: Callable[[dict], None], path: Path, check: bool,
            after: Callable[[dict], None] | None = None) -> int:
    """A fit script's main once its arguments are read: build the profile (a ValueError or FileNotFoundError is
    printed as `error: ...` on stderr, exit code 2), print its table, then write_or_check it; after(profile) runs
    once it is written (never with check). Returns the exit code."""
    try:
        profile = build()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_table(profile)
    code = write_or_check(profile, path, check)
    if after is not None and not check:
        after(profile)
    return code
