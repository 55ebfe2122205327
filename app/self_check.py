"""The engine's self-check after a failed step or resize: run every manager's ``check_valid`` and
say which one is broken. Whether the engine can still serve is decided by these checks, never by
a flag set on the path that failed (a rollback that "succeeded" once left no KV pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def first_failure(checks: Iterable[tuple[str, Callable[[], None] | None]]) -> str | None:
    """Run (name, check) pairs in order; the first that raises names the problem, else None.
    A check of None (a component without ``check_valid``) is skipped."""
    for name, check in checks:
        if check is None:
            continue
        try:
            check()
        except Exception as exc:  # NOTE: AssertionError, and whatever a broken component raises
            return f"{name} failed its self-check: {exc!r}"
    return None
