"""`specfleet serve`: the worker process (docs/worker-contract.md, docs/worker.md).

Ports first (NOT_SERVING), then the model, then SERVING. SIGTERM or SIGINT: readiness fails,
health goes NOT_SERVING, new requests are refused, those in flight get --drain-seconds to finish,
then the process exits (0 when every request finished, 1 when the grace period cut some off).
`--check-config FILE` only judges an engine.json (no torch, no weights loaded) and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from specfleet_api.engine_config import HEAD_KINDS, model_cache
from specfleet_api.enums import Method

from .config import EngineConfig, LiveConfig

log = logging.getLogger("specfleet.worker")

TINY_MODEL = "tiny-random"  # a random 2-layer model for tests, with a character tokenizer (text, chat)
CONTROL_FILE = "control.json"
# prompt tokens prefilled a step, at most (0: whole prompts in one forward, stalling the decodes)
DEFAULT_PREFILL_CHUNK = 0
# the exit path's steps after the drain take at most this long together (each has its own bound);
# past the drain plus this, the watchdog ends the process
EXIT_MARGIN_S = 20.0
T = TypeVar("T")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specfleet serve", description="Run the gRPC speculative-decoding worker.")
    p.add_argument("--config", default=None, help="engine.json (docs/worker-contract.md); default: SmolLM2 + n-gram")
    p.add_argument("--host", default="127.0.0.1", help="listen address (pods pass 0.0.0.0)")
    p.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port (logged)")
    p.add_argument("--http-port", type=int, default=8080, help="/metrics, /healthz, /readyz; 0 picks a free port")
    p.add_argument("--admin-host", default="127.0.0.1",
                   help="listen address of the Admin service (unauthenticated: it turns speculation off and moves "
                        "K); pods pass 0.0.0.0 behind a NetworkPolicy that admits only the operator")
    p.add_argument("--admin-port", type=int, default=50060, help="the Admin service's gRPC port; 0 picks a free port")
    p.add_argument("--drain-seconds", type=float, default=30.0, help="grace period after SIGTERM")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests in the running batch")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more: RESOURCE_EXHAUSTED")
    p.add_argument("--max-tokens-limit", type=int, default=2048, help="the largest max_tokens a request may ask")
    p.add_argument("--max-kv-tokens", type=int, default=32768, help="KV cache size in tokens")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompt tokens prefilled a step, at most: a longer prompt is prefilled over several steps "
                        "while the running requests decode (chunked prefill); 0: whole prompts")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger requests: INVALID_ARGUMENT")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--live-state-period", type=float, default=0.5,
                   help="seconds between two reads of the deployment's live state in Redis "
                        "(with SPECFLEET_REDIS_URL and SPECFLEET_DEPLOYMENT)")
    p.add_argument("--log-level", default=os.environ.get("SPECFLEET_LOG_LEVEL", "INFO"))
    p.add_argument("--check-config", metavar="FILE", default=None,
                   help="only check an engine.json: method, precision and URI served, weights present here "
                        "(as the worker looks for them); exit 0 with one line of OK, else 2 with the reasons")
    p.add_argument("--skip-files", action="store_true",
                   help="with --check-config: do not look for the weights (on a machine other than the worker's)")
    args = p.parse_args(argv)
    if args.skip_files and not args.check_config:
        p.error("--skip-files goes with --check-config")
    for name in ("max_batch_size", "max_tokens_limit", "max_kv_tokens", "max_request_bytes"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.max_queue < 0 or args.drain_seconds < 0 or args.prefill_chunk < 0:
        p.error("--max-queue, --drain-seconds and --prefill-chunk must be >= 0")
    if args.live_state_period <= 0:
        p.error("--live-state-period must be > 0")
    return args


def _model_source(cfg: EngineConfig) -> str:
    """The model's uri when it names a file that exists (as is or in the model cache), else its name."""
    return cfg.model_source(model_cache())


def _draft_source(cfg: EngineConfig) -> str:
    """Where the draft's weights are read from: draft.uri's file or folder, as is or in the model
    cache, or the weights the image carries under that name."""
    found = cfg.draft_source(model_cache())
    return str(found) if found else (cfg.draft_uri or "")


def check_config(path: str, *, files: bool = True) -> int:
    """`specfleet serve --check-config`: judge engine.json as this worker would, loading nothing.

    Prints one line of OK and returns 0, or prints each problem (one a line, on stderr) and
    returns 2. With files=False the weights are not looked for: their presence only means
    something where the worker runs (its image and its model cache)."""
    try:
        cfg = EngineConfig.load(path, check=False)
    except (OSError, ValueError) as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 2
    problems = cfg.problems()
    if files and not problems:
        # the tests' tiny model is built in memory, as `_build_engine` does: no file to look for
        problems = [p for p in cfg.file_problems(model_cache()) if not (p.field == "model.uri" and _tiny(cfg))]
    if files and not problems and cfg.draft_method in HEAD_KINDS:
        problems = head_problems(cfg)
    for problem in problems:
        print(f"{path}: {problem}", file=sys.stderr)
    if problems:
        return 2
    weights = (TINY_MODEL if _tiny(cfg) else cfg.target_weights(model_cache())) if files else \
        "weights not checked: --skip-files"
    guard = f", latency guard {cfg.max_slowdown * 100:g}%" if cfg.max_slowdown is not None else ""
    shape = f", tree choices {len(cfg.tree_choices)} nodes" if cfg.tree_choices else ""
    mixed = " + ngram mixed" if cfg.ngram_mix else ""
    print(f"OK {path}: model {cfg.model_name} ({weights}), draft {cfg.draft_method}{mixed}, "
          f"quantization {cfg.quantization}, dtype {cfg.dtype}, kPolicy {cfg.k_policy}{guard}{shape}")
    return 0


def _tiny(cfg: EngineConfig) -> bool:
    """Whether engine.json names the tests' tiny random model (built in memory, no weights)."""
    return TINY_MODEL in (cfg.model_name, cfg.model_uri)


def head_problems(cfg: EngineConfig) -> list[str]:
    """Why the learned head at draft.uri (an EAGLE head, or Medusa heads, as draft.method says)
    cannot serve the target, read from the files' headers (the head's config, the target's
    metadata: no weights loaded); [] when it fits. The weights' fingerprint is checked when the
    worker loads them."""
    from specfleet_engine.draft_head import HeadConfig, read_config
    from specfleet_engine.loader import read_model_args
    from specfleet_engine.medusa_head import MedusaConfig
    from specfleet_engine.testing import tiny_args

    config_class = MedusaConfig if cfg.draft_method == Method.MEDUSA else HeadConfig
    try:
        head = read_config(_draft_source(cfg), config_class)
        source = _model_source(cfg)
        args = tiny_args() if _tiny(cfg) else read_model_args(source)
    except (OSError, ValueError) as e:
        return [f"draft.uri: {e}"]
    what = "the Medusa heads do" if cfg.draft_method == Method.MEDUSA else "the head does"
    return [f"draft.uri: {what} not fit the target: {p}" for p in head.shape_problems(args)]


def on_short_lived_thread(fn: Callable[[], T]) -> T:
    """fn() run on a thread that exits before this returns; its result, or its exception.

    libgomp, torch's OpenMP, keeps a team of helper threads for every thread that has run a
    parallel region, for as long as that thread lives. Once there are more of them than cores,
    every team stops spinning between regions and each op pays a wake-up: on a 2-core machine, a
    decoding step run by the scheduler thread took 1.6x as long when the model had been loaded by
    the (still living) main thread. Loading on a thread that exits leaves the scheduler's team the
    only one."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="build-engine")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def build_engine(cfg: EngineConfig, *, max_kv_tokens: int = 32768, threads: int | None = None,
                 max_batch_size: int = 16, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
    """The engine for engine.json (see `_build_engine`), built on a short-lived thread.
    prefill_chunk: prompt tokens prefilled a step, at most (0: whole prompts)."""
    return on_short_lived_thread(lambda: _build_engine(cfg, max_kv_tokens, threads, max_batch_size, prefill_chunk))


def _build_engine(cfg: EngineConfig, max_kv_tokens: int, threads: int | None, max_batch_size: int,
                  prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
    """The engine for engine.json, built from the engine's own factory, its step costs calibrated.

    The engine's K policy (`speculation.kPolicy`) chooses each request's K within the live bounds
    that the scheduler applies; `adaptive` prices drafts with the calibrated step costs, under the
    latency guard when `speculation.latencyGuard` sets one."""
    import torch

    from specfleet_engine.engine import Engine
    from specfleet_engine.kernels import cpu_gemm
    from specfleet_engine.proposers import default_proposers

    if threads:
        torch.set_num_threads(threads)
    if _tiny(cfg):
        from specfleet_engine.testing import CharTokenizer, tiny_model

        model, tokenizer = tiny_model(seed=0, scale=4.0), CharTokenizer()
        proposers = default_proposers(cfg.ngram_corpus_tokens)
        if cfg.draft_method in HEAD_KINDS:
            from specfleet_engine.factory import eagle_proposer, medusa_proposer, mix_ngram

            learned = eagle_proposer if cfg.draft_method == Method.EAGLE else medusa_proposer
            proposers[cfg.draft_method] = learned(_draft_source(cfg), model)
            if cfg.ngram_mix:
                mix_ngram(proposers)
    else:
        from specfleet_engine.factory import build_engine_parts

        draft = cfg.draft_uri if cfg.draft_method == Method.DRAFT_MODEL else None
        head = _draft_source(cfg) if cfg.draft_method == Method.EAGLE else None
        medusa = _draft_source(cfg) if cfg.draft_method == Method.MEDUSA else None
        model, tokenizer, proposers = build_engine_parts(_model_source(cfg), cfg.dtype, cfg.quantization, draft, threads,
                                                         device=cfg.device, ngram_corpus_tokens=cfg.ngram_corpus_tokens,
                                                         draft_head=head, medusa_head=medusa, ngram_mix=cfg.ngram_mix)
    engine = Engine(model, tokenizer, proposers=proposers, max_kv_tokens=max_kv_tokens, k_policy=cfg.k_policy,
                    tree_branching=cfg.tree_branching, tree_depth=cfg.tree_depth, tree_choices=cfg.tree_choices,
                    max_slowdown=cfg.max_slowdown, prefill_chunk=prefill_chunk or None)
    k_max = max(cfg.k_max, 8)
    engine.calibrate(sizes=calibration_sizes(max_batch_size * (k_max + 1)))
    log.info("calibrated step costs", extra={"relative_cost_by_rows": engine.costs.relative()})
    log.info(f"cpu kernel: {cpu_gemm.kernel_summary()}")  # the path our CPU GEMM runs (avx2, ...)
    return engine


def calibration_sizes(max_rows: int) -> list[int]:
    """Row counts to time: every one up to 12, then doubling up to max_rows (past 12 rows a step
    is compute-bound and its cost nearly linear in rows: the curve interpolates between them).

    >>> calibration_sizes(144)
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 32, 64, 144]
    """
    sizes = list(range(1, min(12, max_rows) + 1))
    r = 16
    while r * 2 <= max_rows:
        sizes.append(r)
        r *= 2
    return sizes + ([max_rows] if max_rows > sizes[-1] else [])


def make_worker(engine, cfg: EngineConfig, *, max_batch_size: int = 16, max_queue: int = 64,
                max_tokens_limit: int = 2048, max_request_bytes: int = 1 << 20, tracer=None, registry=None):
    """Scheduler (started) + Worker around an engine; tests and the benchmark build theirs here."""
    from .metrics import Metrics
    from .scheduler import Scheduler
    from .service import Worker

    live = LiveConfig(cfg, list(engine.proposers))
    metrics = Metrics(cfg.model_name, cfg.quantization, registry)
    scheduler = Scheduler(engine, live, metrics, max_batch_size=max_batch_size, max_queue=max_queue).start()
    return Worker(scheduler, live, model_name=cfg.model_name, quantization=cfg.quantization, role=cfg.role,
                  tree_branching=cfg.tree_branching, max_tokens_limit=max_tokens_limit,
                  max_request_bytes=max_request_bytes, tracer=tracer)


def watch_control_file(path: Path, live: LiveConfig, stop: threading.Event, period_s: float = 2.0,
                       deferred: Callable[[], bool] = lambda: False) -> None:
    """Applies control.json (the operator's run-time knobs) whenever its content changes.

    While `deferred()` is true (the live state from Redis is in force: it is the fresher copy, a
    mounted ConfigMap lags) a change is noted but not applied; control.json is what a worker
    starts from, and what moves it while Redis is away."""
    last = None
    while not stop.wait(period_s if last is not None else 0):
        try:
            text = path.read_text()
        except OSError:
            last = ""
            continue
        if text == last:
            continue
        last = text
        if deferred():
            log.info("control file changed; the live state from Redis is in force", extra={"path": str(path)})
            continue
        try:
            live.apply_control_file(json.loads(text))
            log.info("applied control file", extra={"path": str(path)})
        except (ValueError, TypeError) as e:
            log.error("ignoring control file", extra={"path": str(path), "error": str(e)})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check_config:
        return check_config(args.check_config, files=not args.skip_files)
    from . import logs

    logs.configure(args.log_level)
    from .fleet import window_from_env
    from .live import deployment_from_env

    try:
        cfg = EngineConfig.load(args.config) if args.config else EngineConfig()
        deployment_from_env()
        window_from_env()
    except (OSError, ValueError) as e:
        log.error("bad configuration", extra={"config": args.config, "error": str(e)})
        return 2

    # SIGTERM/SIGINT from here on only set `stop` (before: the default, an immediate exit): the
    # exit path (exit_worker) is bounded wherever it comes, imports, model load or serving
    stop, stop_or_loaded = threading.Event(), threading.Event()
    from .shutdown import on_signals

    on_signals(lambda _: (stop.set(), stop_or_loaded.set()))  # off the handler: it may take no lock
    from .app import WorkerServer
    from .tracing import make_tracer

    server = WorkerServer(args.host, args.grpc_port, args.http_port, admin_host=args.admin_host,
                          admin_port=args.admin_port,
                          max_workers=args.max_batch_size + args.max_queue + 16,
                          max_receive_bytes=max(args.max_request_bytes * 2, 64 << 20)).start()
    loaded: dict = {}

    def load() -> None:
        try:
            loaded["engine"] = build_engine(cfg, max_kv_tokens=args.max_kv_tokens, threads=args.threads,
                                            max_batch_size=args.max_batch_size, prefill_chunk=args.prefill_chunk)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            loaded["error"] = e
        finally:
            stop_or_loaded.set()

    log.info("loading model", extra={"model": cfg.model_name, "uri": cfg.model_uri})
    if not stop.is_set():
        threading.Thread(target=load, name="load", daemon=True).start()
    while not stop_or_loaded.wait(0.5):
        pass
    if stop.is_set():  # while loading: nothing was served; the load thread is left behind
        return exit_worker(server, None, args, code=0, why="signal while loading")
    if "error" in loaded:
        log.error("could not load the model", extra={"error": str(loaded["error"])})
        return exit_worker(server, None, args, code=2, why="the model did not load")

    worker = make_worker(loaded["engine"], cfg, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                         max_tokens_limit=args.max_tokens_limit, max_request_bytes=args.max_request_bytes,
                         tracer=make_tracer(os.environ.get("OTEL_SERVICE_NAME", "specfleet-worker")))
    from .fleet import FleetPublisher
    from .live import LiveStateFollower

    follower = LiveStateFollower.from_env(worker.live, cfg.role, period_s=args.live_state_period,
                                          registry=worker.scheduler.metrics.registry, model=cfg.model_name)
    if follower is not None:
        follower.start()
    server.attach(worker)
    fleet = FleetPublisher.from_env(worker)
    if fleet is not None:
        fleet.start()
    if args.config:
        control = Path(args.config).parent / CONTROL_FILE
        threading.Thread(target=watch_control_file, args=(control, worker.live, stop),
                         kwargs={"deferred": lambda: follower is not None and follower.in_sync},
                         name="control", daemon=True).start()
    while not stop.wait(0.5):
        if not worker.scheduler.alive:
            log.error("the scheduler thread stopped; exiting")
            return exit_worker(server, worker, args, follower, fleet, code=1, why="the scheduler stopped")
    return exit_worker(server, worker, args, follower, fleet, why="signal")


def exit_worker(server, worker, args: argparse.Namespace, follower=None, fleet=None, *,
                code: int | None = None, why: str) -> int:
    """The exit path, every step bounded, timed and logged (`shutdown.Shutdown`): the drain of
    the requests in flight (--drain-seconds; none in flight, none waited for), the Redis threads,
    the scheduler, the gRPC and HTTP servers, the trace exporter; then the process ends with
    os._exit. `code` None: 0 when every request in flight finished, else 1.

    A watchdog ends the process, naming the step it hung on, if all of it takes longer than the
    drain plus EXIT_MARGIN_S."""
    from .shutdown import Shutdown
    from .tracing import flush_tracing

    down = Shutdown(args.drain_seconds + EXIT_MARGIN_S).arm(why=why)
    # not ready, NOT_SERVING, new requests refused: from here what is in flight can only shrink
    down.step("stop serving", server.refuse, timeout_s=3)
    in_flight = worker.scheduler.in_flight() if worker is not None else 0
    # the drain waits only when something is in flight (--drain-seconds at most)
    drain_s = args.drain_seconds if in_flight else 0.0
    done = down.step("drain", lambda: server.drain(drain_s), timeout_s=drain_s + 3, default=False)
    if follower is not None:
        down.step("live-state follower", lambda: follower.stop(timeout_s=2.0), timeout_s=3)
    if fleet is not None:
        down.step("fleet publisher", fleet.stop, timeout_s=5)  # one Redis call of at most 2 s (connect, then delete)
    if worker is not None:
        down.step("scheduler", lambda: worker.scheduler.stop(timeout_s=2.0), timeout_s=3)
    down.step("grpc server", lambda: server.stop_grpc(grace_s=1.0, timeout_s=2.0), timeout_s=4)
    down.step("admin server", lambda: server.stop_admin(timeout_s=1.0), timeout_s=2)
    down.step("http server", server.stop_http, timeout_s=2)
    down.step("trace exporter", lambda: flush_tracing(timeout_s=2.0), timeout_s=3)
    if code is None:
        code = 0 if done else 1
    down.finish(code, all_requests_finished=bool(done))
    return code  # only when `finish` was told not to end the process (tests)


if __name__ == "__main__":
    import sys

    sys.exit(main())
