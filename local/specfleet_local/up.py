"""`specfleet up -f FILE`: one SpecDecodeDeployment's fleet on this machine, from the file a
cluster would get (docs/local.md).

Started in this order, all on 127.0.0.1: a redis-server of its own holding the live state (the
local stand-in for the operator's writer, `state.StateWriter`), the stable and canary workers
(`specfleet serve` from the engine.json the operator renders for each arm), the router (the
OpenAI API). SIGINT or SIGTERM stops them in the order that drains requests in flight: the
router first, then the workers, then Redis; `up` then exits 0.

With `engine: {name: vllm}` the workers are vLLM servers (`pools.PoolServer`, one per replica of
each pool in the plan), all started at once on the model's Hugging Face folder (`hf_model`), and
the router is given each as `--vllm-backend ARM/METHOD=HOST:PORT`; the rest is the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn
from rich.table import Table

from specfleet_api import redis_auth
from specfleet_api import vllm as vllm_api
from specfleet_api.live_state import state_key

from . import runfile
from .plan import Plan, SpecError, VllmServerPlan, load_resource, make_plan
from .pools import PoolServer
from .procs import Child, spawn
from .redis_server import RedisServer
from specfleet_control.slo import SloPolicy
from specfleet_worker.shutdown import on_signals

from .state import ControlLoop, HoldSpec, StateWriter, gate_key, initial_state
from .vllm import VllmError, vllm_python

HOST = "127.0.0.1"  # everything `up` starts listens on loopback only
EXPORT_TIMEOUT_S = 600.0  # exporting the model for vLLM: 15 s on a 2-core machine


class UpError(RuntimeError):
    """Something `up` started failed: the message says what and shows its last log lines."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet up",
        description="Run one SpecDecodeDeployment's fleet on this machine: Redis, the stable and canary workers, "
                    "the router, all on 127.0.0.1, from the same file a cluster would get. Ctrl-C stops it all "
                    "(requests in flight drained). See docs/local.md.")
    p.add_argument("-f", "--filename", required=True, metavar="FILE",
                   help="the SpecDecodeDeployment YAML (as `kubectl apply -f` takes it)")
    g = p.add_argument_group("what runs")
    g.add_argument("--model", default=None,
                   help="run this model instead of the file's spec.model: a bundled name (smollm2-135m), "
                        "tiny-random (the random test model), or a local .gguf file or checkpoint folder")
    g.add_argument("--workers-per-arm", type=int, default=None, metavar="N",
                   help="worker processes per arm, in place of spec.replicas / scaling / canary.replicas "
                        "(default 1; an engine vllm fleet runs the spec's pool sizes)")
    g.add_argument("--worker-threads", type=int, default=None, metavar="N",
                   help="torch threads per worker (default: this machine's cores / workers, at least 1); with "
                        "engine vllm, the cores each vLLM server binds (default: an equal share, at least 1)")
    g.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every `specfleet serve` (e.g. --worker-arg=--max-batch-size=8); "
                        "repeatable")
    g = p.add_argument_group("ports (all on 127.0.0.1; 0 picks a free one)")
    g.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI API (/v1), /metrics, /healthz, /readyz (default 8000)")
    g.add_argument("--grpc-port", type=int, default=50050, help="the router's gRPC front (default 50050)")
    g.add_argument("--redis-port", type=int, default=0, help="the local redis-server (default: a free port)")
    g.add_argument("--worker-ports", type=int, default=0, metavar="BASE",
                   help="worker i listens on gRPC BASE+2i and HTTP (/metrics) BASE+2i+1; vLLM server i on "
                        "BASE+i (default: free ports)")
    g = p.add_argument_group("the control loop (docs/control-loop.md)")
    g.add_argument("--no-loop", action="store_true",
                   help="hold the spec's live state: no SLO fallback (the loop runs by default, as the operator's)")
    g.add_argument("--loop-period", type=float, default=1.0, metavar="SECONDS",
                   help="how often the loop reads the windows and decides (default 1)")
    g = p.add_argument_group("process")
    g.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on Ctrl-C, how long the router, then each worker, gets for requests in flight (default 30)")
    g.add_argument("--ready-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="give up when the workers (or vLLM servers) are not ready after this long (default 900)")
    g.add_argument("--run-file", default=None,
                   help=f"where `specfleet status` finds this fleet (default ${runfile.ENV}, else "
                        "$XDG_RUNTIME_DIR/specfleet/up.json, else ~/.cache/specfleet/up.json)")
    g = p.add_argument_group("the demo (what ./dev run does)")
    g.add_argument("--demo", action="store_true",
                   help="once ready, send a short mixed Spec-Bench workload through the OpenAI API and print "
                        "per prompt type where it went (arm, method) with alpha, tau and tokens/s; keep serving")
    g.add_argument("--exit-after-demo", action="store_true", help="--demo, then stop everything and exit")
    g.add_argument("--demo-prompts", type=int, default=24, metavar="N",
                   help="prompts, round-robin over the Spec-Bench categories (default 24)")
    g.add_argument("--demo-max-tokens", type=int, default=128, metavar="N",
                   help="max_tokens per prompt (default 128)")
    g.add_argument("--demo-clients", type=int, default=4, metavar="N", help="concurrent clients (default 4)")
    g.add_argument("--questions", default=None, help="Spec-Bench questions (default: $SPECFLEET_SPEC_BENCH, else "
                                                     "the shared question.dev.jsonl)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.demo = args.demo or args.exit_after_demo
    console = Console(highlight=False, **({} if sys.stdout.isatty() else {"width": 120}))
    err = Console(stderr=True, highlight=False)
    for flag in ("demo_prompts", "demo_max_tokens", "demo_clients"):
        if getattr(args, flag) < 1:
            err.print(f"specfleet up: error: --{flag.replace('_', '-')} must be at least 1")
            return 2
    if args.demo:
        from specfleet_bench.questions import default_questions

        args.questions = Path(args.questions) if args.questions else default_questions()
        if not args.questions.is_file():
            err.print(f"specfleet up: error: no Spec-Bench questions at {args.questions} for the demo (pass "
                      "--questions or set SPECFLEET_SPEC_BENCH); nothing was started", markup=False)
            return 2
    try:
        plan = make_plan(load_resource(args.filename), args.filename, workers_per_arm=args.workers_per_arm,
                         model=args.model, redis_url=f"a local redis-server on {HOST}", threads=args.worker_threads)
    except SpecError as e:
        err.print(f"specfleet up: {e.source} cannot run; nothing was started:")
        for problem in e.problems:
            err.print(f"  {problem}", markup=False)
        return 2
    except ValueError as e:
        err.print(f"specfleet up: error: {e}", markup=False)
        return 2
    if plan.engine == vllm_api.VLLM:
        if args.worker_arg:
            err.print("specfleet up: error: --worker-arg is for specfleet's workers; a vLLM server's own flags go in "
                      "spec.engine.vllm.args; nothing was started", markup=False)
            return 2
        try:
            vllm_python()
        except VllmError as e:
            err.print(f"specfleet up: {args.filename} runs vLLM servers (spec.engine.name vllm): {e}; nothing was "
                      "started", markup=False)
            return 2
    run_file = Path(args.run_file) if args.run_file else runfile.default_path()
    other = runfile.running(run_file)
    if other is not None:
        err.print(f"specfleet up: already running here (pid {other['pid']}, {other.get('deployment')}, "
                  f"{(other.get('router') or {}).get('openai')}); stop it with Ctrl-C there or `kill "
                  f"{other['pid']}`, or pass another --run-file and other ports", markup=False)
        return 1
    busy = ports_in_use(args, len(plan.servers))
    if busy:
        err.print("specfleet up: " + "; ".join(busy) + "; nothing was started", markup=False)
        return 1

    stop, force = threading.Event(), threading.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():  # a second Ctrl-C: stop waiting for drains
            force.set()
        stop.set()

    on_signals(on_signal)  # on a thread of its own: Event.set in a signal handler can deadlock
    fleet = Fleet(plan, args, run_file, console)
    code = 1
    try:
        code = fleet.run(stop)
    except UpError as e:
        err.print(f"specfleet up: {e}", markup=False)
    except (OSError, RuntimeError) as e:  # redis-server missing or failing, a file that cannot be written
        err.print(f"specfleet up: error: {e}", markup=False)
    finally:
        fleet.shutdown(force)
    return code


def ports_in_use(args: argparse.Namespace, vllm_servers: int = 0) -> list[str]:
    """The ports asked for that something else holds, each with the flag that moves it."""
    wanted = [(args.http_port, "--http-port"), (args.grpc_port, "--grpc-port"), (args.redis_port, "--redis-port")]
    if args.worker_ports:
        ports = vllm_servers or 2 * 2 * (args.workers_per_arm or 1)  # a port a server; two a worker, two arms
        wanted += [(args.worker_ports + i, "--worker-ports") for i in range(ports)]
    out = []
    for port, flag in wanted:
        if not port:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no holder
            try:
                s.bind((HOST, port))
            except OSError:
                out.append(f"port {port} on {HOST} is in use: pick another with {flag}")
    return out


class Fleet:
    """The processes of one `up`, started and stopped in order."""

    def __init__(self, plan: Plan, args: argparse.Namespace, run_file: Path, console: Console):
        self.plan, self.args, self.run_file, self.console = plan, args, run_file, console
        self.workdir = run_file.parent / f"up-{plan.namespace}-{plan.name}"
        self.redis: RedisServer | None = None
        self.writer: StateWriter | None = None
        self.workers: list[Child | PoolServer] = []  # the workers, or with engine vllm the vLLM servers
        self.router: Child | None = None
        self.demo: threading.Thread | None = None
        self.demo_code: int | None = None
        self.started = time.time()

    # -- start -----------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Starts everything, serves until `stop` (or the demo's end with --exit-after-demo); the
        exit code. Shutdown is the caller's (`shutdown`), whatever happened here."""
        self._say_what_runs()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(port=self.args.redis_port or None, workdir=self.workdir, detached=True,
                                 password=secrets.token_hex(32)).start()
        client = self.redis.client()
        self._fleet_user(client)
        state = initial_state(self.plan.spec)
        gate = gate_key(self.plan.namespace, self.plan.name)
        loop = HoldSpec() if self.args.no_loop else ControlLoop(
            self.plan.spec, readiness=self._readiness,
            gate=lambda: (lambda v: v.decode() if isinstance(v, bytes) else v)(client.get(gate)),
            clear_gate=lambda: client.delete(gate))
        self.writer = StateWriter(self.redis.client(), self.plan.namespace, self.plan.name, state, loop=loop,
                                  period_s=self.args.loop_period)
        self.writer.write()
        self.writer.start()
        if self.vllm:
            model = self._vllm_model_folder(stop)
            if model is None:
                return 0
            self.workers = [self._vllm_server(s, n, model) for n, s in enumerate(self.plan.servers)]
        else:
            self.workers = [self._worker(arm.name, i, n) for n, (arm, i) in
                            enumerate((arm, i) for arm in self.plan.arms for i in range(arm.workers))]
        for w in self.workers:  # all at once: a vLLM server compiles for minutes, and the others beside it
            w.start()
        if not self._wait(lambda: all(w.listening.is_set() for w in self.workers), 120, stop, "the workers to listen"):
            return 0
        self.router = self._router().start()
        if not self._wait(self.router.listening.is_set, 60, stop, "the router to listen"):
            return 0
        self._write_run_file("loading")
        if not self._wait_workers_ready(stop):
            return 0
        if not self._wait(self._router_sees_all, 30, stop, "the router to see every worker ready"):
            return 0
        self._write_run_file("serving")
        self._say_serving()
        if self.args.demo:
            self.demo = threading.Thread(target=self._run_demo, args=(stop,), name="demo", daemon=True)
            self.demo.start()
        return self._serve(stop)

    @property
    def vllm(self) -> bool:
        """Whether the fleet's engine is vLLM: its servers stand where the workers stand."""
        return self.plan.engine == vllm_api.VLLM

    @property
    def admin_password_file(self) -> Path:
        return self.workdir / "redis-admin.password"

    @property
    def fleet_password_file(self) -> Path:
        return self.workdir / "redis-fleet.password"

    def _fleet_user(self, client) -> None:
        """The Redis users, as the operator makes them: this process (the loop, `specfleet status`)
        logs in as the admin; the workers and the router as the fleet's own user, which may only read
        the live state and write their own windows. Passwords in 0600 files of the run dir."""
        p = self.plan
        redis_auth.write_secret_file(self.admin_password_file, self.redis.password)
        password = redis_auth.fleet_password(self.redis.password, p.namespace, p.name, uuid.uuid4().hex)
        client.execute_command(*redis_auth.setuser_args(p.namespace, p.name, password))
        redis_auth.write_secret_file(self.fleet_password_file, password)

    def _redis_env(self) -> dict[str, str]:
        """Where the workers and the router find Redis, as the fleet's user."""
        return {redis_auth.URL_ENV: self.redis.url, redis_auth.PASSWORD_ENV: "",  # the file, not an inherited one
                redis_auth.USERNAME_ENV: redis_auth.fleet_username(self.plan.namespace, self.plan.name),
                redis_auth.PASSWORD_FILE_ENV: str(self.fleet_password_file)}

    def _say_what_runs(self) -> None:
        p, c = self.plan, self.console
        c.print(f"[bold]specfleet up[/bold]: {p.deployment} from {self.args.filename}, model {p.model_name}, "
                f"arms {', '.join(f'{a.name} ({a.workers})' for a in p.arms)}")
        if p.overrides:
            c.print("Overridden for this machine (cluster-only fields):")
            for o in p.overrides:
                c.print(f"  {o}", markup=False)
        if self.args.no_loop:
            for text in p.not_run:
                c.print(f"Held by --no-loop: {text}", markup=False)
        if self.vllm:
            pools = {}
            for s in p.servers:
                pools[f"{s.arm}/{s.method}"] = pools.get(f"{s.arm}/{s.method}", 0) + 1
            c.print("vLLM servers (.venv-vllm), a pool per arm and draft method: " +
                    ", ".join(f"{pool} ({n})" for pool, n in pools.items()), markup=False)

    def _vllm_model_folder(self, stop: threading.Event) -> Path | None:
        """The Hugging Face folder the vLLM servers load: the plan's, or the one `hf_model` exports
        (torch: in a child process, so that `up` stays torch-free); None when stopped first."""
        m = self.plan.vllm_model
        if m.folder:
            return Path(m.folder)
        log = self.workdir / "logs" / "export-hf.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with self.console.status(f"The model for vLLM: {m.export} as a Hugging Face folder (exported once into "
                                 "specfleet's cache, about 15 s; then reused)"):
            with open(log, "wb") as f:
                proc = spawn([sys.executable, "-m", "specfleet_local.hf_model", m.export], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=f)
            while proc.poll() is None:
                if stop.wait(0.2) or time.monotonic() - start > EXPORT_TIMEOUT_S:
                    proc.kill()
                    proc.wait(10)
                    if stop.is_set():
                        return None
                    raise UpError(f"exporting {m.export} took over {EXPORT_TIMEOUT_S:.0f} s; its log: {log}")
        out = proc.stdout.read().decode().strip()
        proc.stdout.close()
        if proc.returncode != 0 or not out:
            lines = "\n".join(f"  {line}" for line in log.read_text(errors="replace").splitlines()[-8:])
            raise UpError(f"could not write {m.export} as a Hugging Face folder for vLLM (exit {proc.returncode}):\n"
                          f"{lines}\n  (whole log: {log})")
        folder = Path(out.splitlines()[-1])
        self.console.print(f"The model for vLLM: {folder} ({time.monotonic() - start:.0f} s)", markup=False)
        return folder

    def _vllm_server(self, planned: VllmServerPlan, n: int, model: Path) -> PoolServer:
        port = self.args.worker_ports + n if self.args.worker_ports else None
        return PoolServer(planned, model, self.workdir / "logs" / f"{planned.name}.log", port=port,
                          ready_timeout_s=self.args.ready_timeout + 60)  # `up`'s own --ready-timeout first

    def _worker(self, arm: str, index: int, n: int) -> Child:
        p, a = self.plan, self.args
        config_dir = self.workdir / arm
        config_dir.mkdir(parents=True, exist_ok=True)
        arm_plan = p.arm(arm)
        (config_dir / "engine.json").write_text(json.dumps(arm_plan.engine, indent=2, sort_keys=True) + "\n")
        (config_dir / "control.json").write_text(json.dumps(arm_plan.control, indent=2, sort_keys=True) + "\n")
        name = f"{p.name}-{arm}-{index}"
        threads = a.worker_threads or max(1, (os.cpu_count() or 1) // sum(x.workers for x in p.arms))
        grpc_port, http_port = (a.worker_ports + 2 * n, a.worker_ports + 2 * n + 1) if a.worker_ports else (0, 0)
        cmd = [sys.executable, "-m", "specfleet_cli.main", "serve", "--config", str(config_dir / "engine.json"),
               "--host", HOST, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
               # Admin on a free loopback port: the default one would collide between workers on one host
               "--admin-port", "0", "--drain-seconds", str(a.drain_seconds), "--threads", str(threads), *a.worker_arg]
        env = {**self._redis_env(), "SPECFLEET_DEPLOYMENT": p.deployment, "POD_NAME": name,
               "SPECFLEET_FLEET_WINDOW_S": str(self.window_s),
               "OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_SERVICE_NAME": f"specfleet-{p.name}-{arm}",
               "OMP_NUM_THREADS": str(threads)}
        return Child(name, cmd, self.workdir / "logs" / f"{name}.log", env, arm=arm)

    def _readiness(self) -> dict[str, tuple[int, int]]:
        """(ready, desired) workers per arm, as the operator reads them from the Deployments."""
        workers = getattr(self, "workers", None) or []
        return {arm.name: (sum(1 for w in workers if w.arm == arm.name and w.ready.is_set()), arm.workers)
                for arm in self.plan.arms}

    @property
    def window_s(self) -> float:
        """The SLO window: the length of the windows workers and the router publish."""
        return SloPolicy.from_spec(self.plan.spec).window_s

    def _router(self) -> Child:
        p, a, state = self.plan, self.args, self.writer.state
        cmd = [sys.executable, "-m", "specfleet_cli.main", "router", "--host", HOST,
               "--http-port", str(a.http_port), "--grpc-port", str(a.grpc_port),
               "--deployment", p.deployment, "--redis-url", self.redis.url,
               "--drain-seconds", str(a.drain_seconds),
               # the state until its first read of Redis: the same one
               "--canary-weight", str(state.canary_weight), "--default-method", state.default_method]
        for t, m in sorted(state.routes.items()):
            cmd += ["--route", f"{t}={m}"]
        if p.model_name != p.name:
            cmd += ["--model-alias", p.model_name]
        for w in self.workers:
            cmd += (["--vllm-backend", f"{w.arm}/{w.method}={HOST}:{w.ports['http']}"] if self.vllm else
                    ["--backend", f"{w.arm}={HOST}:{w.ports['grpc']}"])
        return Child("router", cmd, self.workdir / "logs" / "router.log",
                     {"POD_NAME": f"{p.name}-router", "SPECFLEET_FLEET_WINDOW_S": str(self.window_s),
                      **{k: v for k, v in self._redis_env().items() if k != redis_auth.URL_ENV}})

    def _wait(self, done, timeout_s: float, stop: threading.Event, what: str) -> bool:
        """True once done(); False when stopped first; UpError when a process died or time ran out."""
        end = time.monotonic() + timeout_s
        while not done():
            if stop.is_set():
                return False
            self._check_alive(starting=True)
            if time.monotonic() > end:
                raise UpError(f"gave up waiting {timeout_s:.0f} s for {what}")
            time.sleep(0.1)
        return True

    def _check_alive(self, starting: bool) -> None:
        """UpError when a process that must live died (any while starting; Redis, the router or the
        last worker while serving)."""
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
            raise UpError(f"redis-server exited (code {self.redis.proc.returncode})")
        if self.router is not None and not self.router.alive():
            raise UpError(f"the router exited (code {self.router.proc.returncode}); its last lines:\n"
                          f"{self.router.last_lines()}")
        dead = [w for w in self.workers if w.proc is not None and not w.alive()]
        if dead and (starting or len(dead) == len(self.workers)):
            w = dead[0]
            raise UpError(f"{self._kind} {w.name} exited (code {w.proc.returncode}); its last lines:\n"
                          f"{w.last_lines()}")

    @property
    def _kind(self) -> str:
        return "vLLM server" if self.vllm else "worker"

    def _wait_workers_ready(self, stop: threading.Event) -> bool:
        """Progress, one line a worker, until all are ready; False when stopped first."""
        end = time.monotonic() + self.args.ready_timeout
        n = len(self.workers)
        if self.vllm:
            self.console.print(f"Starting {n} vLLM server{'s' * (n > 1)} at once (each compiles the model at every "
                               "start: about 100 s a server on a quiet 2-core machine, longer side by side; shown: "
                               "CPU time used, last log line):")
        else:
            self.console.print(f"Loading {n} worker{'s' * (n > 1)} "
                               "(model load, then step-cost calibration; about 30 s for SmolLM2 on a 2-core machine):")
        with Progress(SpinnerColumn(finished_text="[green]✓[/green]"), TextColumn("{task.description:<24}"),
                      TextColumn("{task.fields[phase]}"), console=self.console) as progress:
            tasks = {w.name: progress.add_task(w.name, total=None, phase=w.phase) for w in self.workers}
            shown: set[str] = set()
            while len(shown) < len(self.workers):
                for w in self.workers:
                    if w.name in shown:
                        continue
                    if w.ready.is_set():
                        progress.update(tasks[w.name], phase=f"ready in {w.ready_after:.1f} s", total=1, completed=1)
                        shown.add(w.name)
                    else:
                        progress.update(tasks[w.name], phase=f"{w.phase} ({time.monotonic() - w.started_at:.0f} s)")
                if stop.is_set():
                    return False
                self._check_alive(starting=True)
                if time.monotonic() > end:
                    raise UpError(f"the {self._kind}s were not ready within --ready-timeout "
                                  f"{self.args.ready_timeout:.0f} s")
                time.sleep(0.2)
        return True

    def _router_sees_all(self) -> bool:
        from .status import router_backends

        try:
            ready = router_backends(self.router_url())
        except OSError:
            return False
        return all(ready.get(a.name, (0, 0))[1] >= a.workers for a in self.plan.arms)

    def router_url(self) -> str:
        return f"http://{HOST}:{self.router.ports['http']}"

    def _say_serving(self) -> None:
        p, url = self.plan, self.router_url()
        aliases = f" (or '{p.model_name}')" if p.model_name != p.name else ""
        self.console.print(f"[bold green]Serving[/bold green] {p.deployment}: OpenAI API at [bold]{url}/v1[/bold], "
                           f"model '{p.name}'{aliases}; up in {time.time() - self.started:.0f} s")
        grid = Table.grid(padding=(0, 2))
        grid.add_row("router", f"gRPC {HOST}:{self.router.ports['grpc']}, metrics {url}/metrics, log {self.router.log_path}")
        for w in self.workers:
            if self.vllm:
                grid.add_row(w.name, f"vLLM, {w.arm} arm's {w.method} pool: OpenAI {w.url}/v1, metrics "
                                     f"{w.url}/metrics, cores {w.planned.cpus}, log {w.log_path}")
            else:
                grid.add_row(w.name, f"gRPC {HOST}:{w.ports['grpc']}, metrics http://{HOST}:{w.ports['http']}/metrics, "
                                     f"threads {w.cmd[w.cmd.index('--threads') + 1]}")
        s = self.writer.state
        grid.add_row("redis", f"{self.redis.url}, live state at {state_key(p.namespace, p.name)} (version {s.version}: "
                              f"canary {s.canary_weight:g}%, default method {s.default_method})")
        grid.add_row("files", f"{self.workdir} ({'' if self.vllm else 'engine.json per arm, '}logs/); run file "
                              f"{self.run_file}")
        self.console.print(grid)
        self.console.print("`specfleet status` shows the fleet; Ctrl-C stops it all.")

    def _write_run_file(self, phase: str) -> None:
        p, url = self.plan, self.router_url()
        runfile.write(self.run_file, {
            "pid": os.getpid(), "phase": phase, "deployment": p.deployment, "file": str(self.args.filename),
            "model": p.model_name, "started": self.started, "workdir": str(self.workdir),
            "redis": {"url": self.redis.url, "pid": self.redis.proc.pid,
                      "passwordFile": str(self.admin_password_file)},
            "router": {"url": url, "openai": f"{url}/v1", "grpc": f"{HOST}:{self.router.ports['grpc']}",
                       "pid": self.router.pid, "log": str(self.router.log_path)},
            "engine": p.engine,
            "workers": [({"name": w.name, "arm": w.arm, "method": w.method, "pid": w.pid, "openai": f"{w.url}/v1",
                          "metrics": f"{w.url}/metrics", "cpus": w.planned.cpus, "log": str(w.log_path)}
                         if self.vllm else
                         {"name": w.name, "arm": w.arm, "pid": w.pid, "grpc": f"{HOST}:{w.ports['grpc']}",
                          "metrics": f"http://{HOST}:{w.ports['http']}/metrics", "log": str(w.log_path)})
                        for w in self.workers],
            "arms": {a.name: {"workers": a.workers} for a in p.arms},
        })

    # -- serve -----------------------------------------------------------------------------------

    def _run_demo(self, stop: threading.Event) -> None:
        from .demo import run_demo

        try:
            self.demo_code = run_demo(self, stop)
        except Exception as e:  # noqa: BLE001 - the demo's failure is reported; the fleet serves on
            self.console.print(f"[red]the demo failed: {type(e).__name__}: {e}[/red]")
            self.demo_code = 1

    def _serve(self, stop: threading.Event) -> int:
        reported: set[str] = set()
        while not stop.wait(0.5):
            self._check_alive(starting=False)
            for w in self.workers:
                if not w.alive() and w.name not in reported:
                    reported.add(w.name)
                    self.console.print(f"[yellow]{self._kind} {w.name} exited (code {w.proc.returncode}); the router "
                                       f"serves on the others. Its last lines:[/yellow]\n{w.last_lines()}")
            if self.demo is not None and not self.demo.is_alive() and self.args.exit_after_demo:
                return self.demo_code or 0
        return 0

    # -- stop ------------------------------------------------------------------------------------

    def shutdown(self, force: threading.Event) -> None:
        """Router, then workers, then Redis; each waited for (its drain), killed after its grace or
        at a second Ctrl-C."""
        if self.router is not None and self.router.ports:
            self._write_run_file("stopping")
        grace = self.args.drain_seconds + 10
        said = []
        if self.router is not None:
            if self.router.alive():
                self.console.print(f"Stopping: the router first (requests in flight get up to "
                                   f"{self.args.drain_seconds:g} s), then the {self._kind}s, then Redis")
            self.router.signal(signal.SIGTERM)
            said.append(f"router (exit {self.router.wait(grace, force)})")
        for w in self.workers:
            w.signal(signal.SIGTERM)
        for w in self.workers:
            said.append(f"{w.name} (exit {w.wait(grace, force)})")
        if self.demo is not None:
            self.demo.join(5)
        if self.writer is not None:
            self.writer.stop()
        if self.redis is not None:
            self.redis.stop()
            said.append("redis-server")
        runfile.remove(self.run_file, os.getpid())
        if said:
            self.console.print("Stopped: " + ", ".join(said))
