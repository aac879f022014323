"""The worker's exit path: every step bounded, timed and logged, a watchdog over the whole.

Each step (the drain, the Redis threads, the scheduler, the gRPC and HTTP servers, the trace
exporter) runs on a thread of its own and is waited for at most its timeout: a step that hangs
(a gRPC `stop().wait()`, a health update waiting on gRPC's poll thread, a Redis call) is logged
as timed out and the exit goes on. Every step logs `shutdown step` with its name and seconds, so
a slow exit names its slow step. A watchdog, armed when the exit starts, ends the process if the
whole takes longer than its deadline: it logs the step it was on and every thread's stack, then
exits 1.

`finish` leaves with os._exit once the logs are flushed: the interpreter's own finalization
(garbage collection over every module's objects, several full passes: 0.3 s idle, seconds on a
loaded 2-core machine; torch's thread pools torn down under a daemon thread that may still be
loading the model, which aborts the process) is nothing a worker that has stopped serving needs.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("specfleet.worker")
T = TypeVar("T")


def on_signals(handler: Callable[[int], None], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Run `handler(signum)` for each of `signals` on a thread of its own, never in the signal
    handler. A Python signal handler runs on the main thread between two bytecodes, wherever that
    thread is: one that sets a threading.Event takes the Event's lock, and when it lands while the
    main thread holds that lock (in another Event.set, e.g. the same handler interrupted by a second
    signal: SIGTERM from the parent's death, then SIGINT), it waits on itself forever (a worker was
    found so, an hour after its parent died). Here the C-level handler writes the signal's number to
    a pipe (signal.set_wakeup_fd: async-signal-safe), the Python-level handler does nothing, and a
    daemon thread reads the pipe and calls `handler`. Call it from the main thread, once.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in signals:
        signal.signal(sig, lambda *_: None)
    wanted = set(signals)

    def deliver() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum in wanted:
                    handler(signum)

    threading.Thread(target=deliver, name="signals", daemon=True).start()


class Shutdown:
    def __init__(self, deadline_s: float, *, exit: Callable[[int], None] = os._exit, stream=None,
                 clock: Callable[[], float] = time.monotonic):
        self.deadline_s, self.clock, self._exit = deadline_s, clock, exit
        self.stream = stream  # where the watchdog writes the stacks; stderr by default
        self.started = clock()
        self.current: str | None = None  # the step under way
        self._done = threading.Event()
        self._watchdog: threading.Thread | None = None

    def arm(self, **why) -> Shutdown:
        """Starts the watchdog (once) and logs that the exit has begun, with `why`."""
        if self._watchdog is None:
            self.started = self.clock()
            log.info("shutting down", extra={"deadline_s": round(self.deadline_s, 1), **why})
            self._watchdog = threading.Thread(target=self._watch, name="shutdown-watchdog", daemon=True)
            self._watchdog.start()
        return self

    def step(self, name: str, fn: Callable[[], T], timeout_s: float, default: T | None = None) -> T | None:
        """fn() on a thread of its own, waited for at most timeout_s: its result, or `default`
        when it timed out or raised (both logged)."""
        box: dict = {}

        def run() -> None:
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - logged below; the exit goes on
                box["error"] = e

        self.current = name
        t0 = self.clock()
        t = threading.Thread(target=run, name=f"shutdown-{name}", daemon=True)
        t.start()
        t.join(timeout_s)
        seconds = round(self.clock() - t0, 3)
        self.current = None
        if t.is_alive():
            log.error("shutdown step timed out; going on without it",
                      extra={"step": name, "seconds": seconds, "timeout_s": timeout_s})
            return default
        if "error" in box:
            log.error("shutdown step failed", extra={"step": name, "seconds": seconds,
                                                     "error": f"{type(box['error']).__name__}: {box['error']}"})
            return default
        log.info("shutdown step", extra={"step": name, "seconds": seconds})
        return box.get("result")

    def finish(self, code: int, **extra) -> None:
        """Logs `exiting`, flushes, and ends the process with `code` (the watchdog stands down)."""
        log.info("exiting", extra={**extra, "exit_code": code, "shutdown_s": round(self.clock() - self.started, 3)})
        self._done.set()
        _flush()
        self._exit(code)

    def _watch(self) -> None:
        if self._done.wait(self.deadline_s):
            return
        # the report on a thread of its own, waited for 2 s: a log stream that blocks (a full pipe)
        # must not keep the process alive
        report = threading.Thread(target=self._report, name="shutdown-report", daemon=True)
        report.start()
        report.join(2.0)
        self._exit(1)

    def _report(self) -> None:
        log.error("shutdown took too long; exiting now", extra={
            "deadline_s": self.deadline_s, "step": self.current, "seconds": round(self.clock() - self.started, 3)})
        stream = self.stream or sys.stderr
        try:
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)  # which thread waits on what
        except (OSError, ValueError, AttributeError):  # no usable stream (a closed pipe): the log line stands
            pass
        _flush()


def _flush() -> None:
    for h in logging.getLogger("specfleet").handlers:
        try:
            h.flush()
        except (OSError, ValueError):
            pass
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError, AttributeError):
            pass
