"""A stop signal must stop a process whatever its main thread holds when the signal lands: a Python
signal handler that sets a threading.Event, landing while the main thread holds that Event's lock
(inside another Event.set: the same handler, interrupted by a second signal), waits on itself
forever. A worker was found so, alive an hour after its parent died. `shutdown.on_signals` runs the
handler on a thread of its own; the process below holds the lock on purpose while two signals land."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    from specfleet_worker.shutdown import on_signals

    stop = threading.Event()
    if sys.argv[1] == "in-handler":  # what the worker and `specfleet up` did
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    else:
        on_signals(lambda signum: stop.set())
    with stop._cond:  # the main thread inside Event.set (or wait's bookkeeping) as the signals land
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes: where a Python-level handler runs
            pass
    print("stopped" if stop.wait(10) else "not stopped", flush=True)
""")


def run(mode: str, timeout_s: float):
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    return done


def test_signals_landing_while_the_main_thread_holds_the_events_lock_still_stop_it():
    done = run("on-signals", timeout_s=60)
    assert done is not None, "hung"
    assert done.returncode == 0 and done.stdout.strip() == "stopped", done.stderr


def test_the_handler_that_sets_the_event_itself_hangs_there():
    """The hazard the helper removes, shown: the same process with the handler setting the Event."""
    assert run("in-handler", timeout_s=10) is None
