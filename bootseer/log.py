"""structlog set-up shared by every daemon: JSON lines in production (when
stderr is not a terminal), readable key=value lines on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", fmt: str = "auto") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    # JSON carries tracebacks as a field; the console renderer draws its own.
    tail: list[structlog.typing.Processor] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        if fmt == "json"
        else [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
