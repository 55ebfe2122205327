"""Records of one named logger, captured on the logger itself: Litestar reconfigures the root logger's handlers when
an app is built, so pytest's caplog (a root handler) misses what a running server logs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def logger_records(name: str, level: int | None = None) -> Iterator[list[logging.LogRecord]]:
    """The records logger `name` emits inside the block; with `level`, the logger's own level meanwhile (None: left
    as it is, since a level can change what the code logs, e.g. a traceback only under DEBUG)."""
    handler, logger = _Records(), logging.getLogger(name)
    kept = logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(kept)
