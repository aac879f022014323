"""Structured logs: one JSON object per line, with the request id whenever there is one.

Pass fields through `extra=` (`log.info("finished", extra={"request_id": rid, ...})`); every
field that is not a standard LogRecord attribute lands in the object.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str = "INFO", stream=None) -> logging.Handler:
    """Routes the `specfleet` loggers to JSON lines on stderr (or `stream`)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("specfleet")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    return handler
