"""Logging: JSON lines when stderr is not a TTY (for journald and log shippers), rich text when it is."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _RESERVED and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(*, debug: bool = False, json_lines: bool | None = None) -> None:
    """Configure the `stagerd` logger once; later calls only change the level."""
    logger = logging.getLogger("stagerd")
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    if getattr(logger, "_stagerd_configured", False):
        return
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    if json_lines:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    else:
        from rich.logging import RichHandler

        handler = RichHandler(show_path=False, log_time_format="[%X]")
    logger.addHandler(handler)
    logger.propagate = False
    logger._stagerd_configured = True  # type: ignore[attr-defined]
    logging.Formatter.converter = time.gmtime
