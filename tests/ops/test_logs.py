"""Logging: JSON lines off a terminal carry every `extra=` field; set up once, re-calls change the level."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from stagerd.ops.logs import JsonFormatter
from tests.cli_helpers import clean_env

CHILD = """
import logging
from stagerd.ops.logs import setup_logging
setup_logging()
setup_logging(debug=True)  # a second call only changes the level: still one handler
log = logging.getLogger("stagerd")
log.debug("debug line")
log.info("step %d exported", 7, extra={"step": 7, "bytes": 123, "path": "/r/step-00000007"})
try:
    raise ValueError("boom")
except ValueError:
    log.exception("failed")
print(len(log.handlers))
"""


def test_json_lines_off_a_terminal() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], env=clean_env(), capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "1"
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [r["msg"] for r in records] == ["debug line", "step 7 exported", "failed"]
    info = records[1]
    assert info["level"] == "info" and info["logger"] == "stagerd"
    assert (info["step"], info["bytes"], info["path"]) == (7, 123, "/r/step-00000007")
    assert "ValueError: boom" in records[2]["exc"]
    assert all(isinstance(r["ts"], float) for r in records)


def test_formatter_keeps_odd_values_printable() -> None:
    record = logging.LogRecord("stagerd", logging.WARNING, __file__, 1, "x %s", ("y",), None)
    record.where = object()  # not JSON: written with str(), never an exception in the logger
    out = json.loads(JsonFormatter().format(record))
    assert out["msg"] == "x y" and out["level"] == "warning" and out["where"].startswith("<object")
