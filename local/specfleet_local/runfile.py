"""Where a running `specfleet up` says what it started, for `specfleet status` and for a person.

One JSON file, written atomically by `up` once the router listens and removed when `up` stops:
`$SPECFLEET_UP_FILE`, else `$XDG_RUNTIME_DIR/specfleet/up.json`, else `~/.cache/specfleet/up.json`
(both commands take `--run-file`). `up`'s own files (engine.json per arm, logs) go in a folder
beside it. The document (docs/local.md):

    {"pid": 4242, "phase": "loading" | "serving" | "stopping", "deployment": "default/local",
     "file": "deploy/examples/local.yaml", "model": "smollm2-135m", "started": 1796135413.1,
     "redis": {"url": "redis://127.0.0.1:40100/0", "pid": 4243},
     "router": {"url": "http://127.0.0.1:8000", "openai": "http://127.0.0.1:8000/v1",
                "grpc": "127.0.0.1:50050", "pid": 4250, "log": ".../logs/router.log"},
     "engine": "specfleet",
     "workers": [{"name": "local-stable-0", "arm": "stable", "pid": 4244, "grpc": "127.0.0.1:41234",
                  "metrics": "http://127.0.0.1:41235/metrics", "log": ".../logs/local-stable-0.log"}],
     "arms": {"stable": {"workers": 1}, "canary": {"workers": 1}}, "workdir": "..."}

With engine "vllm" each of "workers" is a vLLM server: {"name": "vllm-local-stable-ngram-0", "arm":
"stable", "method": "ngram", "pid": ..., "openai": "http://127.0.0.1:41300/v1", "metrics":
"http://127.0.0.1:41300/metrics", "cpus": "0", "log": ...}, and "arms" counts the servers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV = "SPECFLEET_UP_FILE"


def default_path() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "specfleet" if runtime else Path.home() / ".cache" / "specfleet"
    return base / "up.json"


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def read(path: Path) -> dict[str, Any] | None:
    """The document, or None when there is none (or it is not one)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(path: Path) -> dict[str, Any] | None:
    """The run file of an `up` that is still running, else None (a stale file is left to be
    overwritten)."""
    doc = read(path)
    return doc if doc is not None and pid_alive(doc.get("pid")) else None


def remove(path: Path, pid: int) -> None:
    """Removes the file if it is still this process's."""
    doc = read(path)
    if doc is not None and doc.get("pid") == pid:
        path.unlink(missing_ok=True)
