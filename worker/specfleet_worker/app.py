"""The worker's listeners: public gRPC (generation, grpc.health.v1, reflection), the admin gRPC
port (`specfleet.v1.Admin` alone: it turns speculation off and moves K, so it listens on loopback
unless told otherwise, and in pods only the operator may reach it), HTTP (/metrics, /healthz,
/readyz), and the life cycle around them.

Both ports come up before the model loads: health says NOT_SERVING and /readyz 503 until
`attach`; `drain` (SIGTERM) flips them back, refuses new requests and lets those in flight
finish; `stop` closes everything.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc
from .service import AdminServicer, GenerationServicer, Worker

log = logging.getLogger("specfleet.worker")

SERVICES = [pb.DESCRIPTOR.services_by_name["Generation"].full_name]  # on the public port
ADMIN_SERVICES = [pb.DESCRIPTOR.services_by_name["Admin"].full_name]  # on the admin port only
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class WorkerServer:
    def __init__(self, host: str = "127.0.0.1", grpc_port: int = 50051, http_port: int = 8080, *,
                 admin_host: str = "127.0.0.1", admin_port: int = 50060,
                 max_workers: int = 64, max_receive_bytes: int = 64 << 20):
        self.worker: Worker | None = None
        self.draining = False
        # The transport limit sits far above the service's own (--max-request-bytes), so that an
        # oversized request reaches the handler and gets INVALID_ARGUMENT naming it, not gRPC's
        # RESOURCE_EXHAUSTED, which clients read as "retry later".
        self.grpc = grpc.server(ThreadPoolExecutor(max_workers, thread_name_prefix="grpc"),
                                options=[("grpc.max_receive_message_length", max_receive_bytes),
                                         ("grpc.so_reuseport", 0)])
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self), self.grpc)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(SERVICES + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc)
        self._set_health(NOT_SERVING)
        self.grpc_port = self.grpc.add_insecure_port(f"{host}:{grpc_port}")
        # Admin on a server of its own, so that no route from the public port reaches it.
        self.admin = grpc.server(ThreadPoolExecutor(4, thread_name_prefix="admin"), options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_AdminServicer_to_server(AdminServicer(self), self.admin)
        reflection.enable_server_reflection(ADMIN_SERVICES + [reflection.SERVICE_NAME], self.admin)
        self.admin_port = self.admin.add_insecure_port(f"{admin_host}:{admin_port}")
        self.http = ThreadingHTTPServer((host, http_port), _http_handler(self))
        self.http.daemon_threads = True
        self.http_port = self.http.server_address[1]
        self._http_thread = threading.Thread(target=self.http.serve_forever, name="http", daemon=True)

    @property
    def ready(self) -> bool:
        return self.worker is not None and not self.draining and self.worker.scheduler.alive

    def _set_health(self, status) -> None:
        for name in ["", *SERVICES]:
            self.health.set(name, status)

    def start(self) -> WorkerServer:
        self.grpc.start()
        self.admin.start()
        self._http_thread.start()
        log.info("listening", extra={"grpc_port": self.grpc_port, "http_port": self.http_port,
                                     "admin_port": self.admin_port})
        return self

    def attach(self, worker: Worker) -> None:
        """The model is loaded and its scheduler runs: start serving."""
        self.worker = worker
        self._set_health(SERVING)
        log.info("ready", extra={"model": worker.model_name})

    def refuse(self) -> None:
        """Not ready, NOT_SERVING, new requests refused (UNAVAILABLE); those in flight go on.
        Once: health watchers are told once (a health update waits on gRPC's poll thread)."""
        if self.worker is not None:
            self.worker.scheduler.refuse()
        if self.draining:
            return
        self.draining = True
        self._set_health(NOT_SERVING)

    def drain(self, timeout_s: float) -> bool:
        """`refuse`, then waits for the requests in flight (True: all done)."""
        self.refuse()
        if self.worker is None:
            return True
        in_flight = self.worker.scheduler.in_flight()
        log.info("draining", extra={"in_flight": in_flight, "grace_s": timeout_s})
        done = self.worker.scheduler.drain(timeout_s)
        log.info("drained" if done else "grace period over", extra={"in_flight": self.worker.scheduler.in_flight()})
        return done

    def stop(self, grace_s: float = 1.0) -> None:
        if self.worker is not None:
            self.worker.scheduler.stop()
        self.stop_grpc(grace_s)
        self.stop_admin()
        self.stop_http()

    def stop_grpc(self, grace_s: float = 1.0, timeout_s: float = 5.0) -> bool:
        """The public gRPC server: calls still open get grace_s, then are cancelled; True once it
        has stopped (at most timeout_s after the grace)."""
        return self.grpc.stop(grace_s).wait(grace_s + timeout_s)

    def stop_admin(self, timeout_s: float = 5.0) -> bool:
        return self.admin.stop(0).wait(timeout_s)

    def stop_http(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _http_handler(server: WorkerServer):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                w = server.worker
                body = generate_latest(w.scheduler.metrics.registry) if w is not None else b""
                return self._reply(200, body, CONTENT_TYPE_LATEST)
            if path == "/healthz":
                # liveness: the process answers and, once loaded, its scheduler thread runs
                alive = server.worker is None or server.worker.scheduler.alive
                return self._reply(200 if alive else 503, b"ok\n" if alive else b"scheduler thread stopped\n")
            if path == "/readyz":
                if server.ready:
                    return self._reply(200, b"ready\n")
                why = b"draining\n" if server.draining else b"loading\n" if server.worker is None else b"not serving\n"
                return self._reply(503, why)
            return self._reply(404, b"not found; try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes every few seconds: keep them out of the logs
            pass

    return Handler
