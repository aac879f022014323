"""The operator's side of the live state: each fleet's document (fleet_spec.live_state, derived from
its spec and status) written to Redis under specfleet_api.live_state.state_key, for the routers
and workers that follow it.

A document is written only when its content differs from what Redis holds, with a version one
above both the stored one and the last one this process wrote, so a follower (which takes a
higher version) sees every change and an unchanged fleet costs one GET. Nothing here raises:
a Redis that is down, paused or read-only is logged once per outage, and writes to it are skipped
for `retry_after_s` after a failure (each try can cost the whole timeout, inside a fleet's status
write); the next write after that (the control loop's next tick at the latest) tries again, while
followers keep their last state.

What the last try of each fleet met is kept (`health`): the status' RedisReady condition says it.
A fleet without spec.redis lives in the operator's default Redis (`DefaultRedis`), which the
operator reaches as its admin and where each fleet has a user of its own that may only read its
live state and write its own windows (specfleet_api.redis_auth); the operator creates that user
before it writes, and the fleet's Secret its pods read it from (create, then patch: never a read).
"""
from __future__ import annotations

import base64
import dataclasses
import logging
import time
from typing import Any, Callable

from specfleet_api import redis_auth
from specfleet_api.live_state import LiveState, state_key

from . import manifests
from .kube import ApiError

log = logging.getLogger("specfleet.operator.redis_state")


def same_content(a: LiveState, b: LiveState) -> bool:
    """Equal but for the version and the time written.

    >>> same_content(LiveState(version=3, canary_weight=1.0), LiveState(version=9, canary_weight=1.0, updated=5.0))
    True
    """
    return dataclasses.replace(a, version=0, updated=0.0) == dataclasses.replace(b, version=0, updated=0.0)


@dataclasses.dataclass(frozen=True)
class Health:
    """What the last try to reach a fleet's Redis met: ok, or why not (reason: Unreachable,
    AuthFailed, NoCredentials) in a message that names the host, never a password."""

    ok: bool
    reason: str = "Connected"
    message: str = ""


@dataclasses.dataclass(frozen=True)
class DefaultRedis:
    """The fleets' default Redis: its URL (no password in it) and its admin password, also the
    master secret each fleet's password is derived from (redis_auth.fleet_password)."""

    url: str
    password: str = dataclasses.field(default="", repr=False)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a fleet's documents go and how the operator logs in there; `fleet_user` (username,
    password): the fleet's own user, made to exist before each first write."""

    url: str
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    fleet_user: tuple[str, str] | None = dataclasses.field(default=None, repr=False)

    def client_key(self) -> tuple[str, str | None]:
        return self.url, self.username

    def credentials(self) -> dict[str, str]:
        return {k: v for k, v in (("username", self.username), ("password", self.password)) if v}


def default_target(default: DefaultRedis, namespace: str, name: str, uid: str) -> Target:
    """The default Redis as the operator reaches it (its admin), with the fleet's user to ensure."""
    user = None
    if default.password:  # without a master secret there is no user to derive: the URL alone
        user = (redis_auth.fleet_username(namespace, name),
                redis_auth.fleet_password(default.password, namespace, name, uid))
    return Target(default.url, password=default.password or None, fleet_user=user)


async def resolve(kube: Any, settings: manifests.Settings, default: DefaultRedis | None, sdd: dict[str, Any],
                  spec: dict[str, Any]) -> tuple[Target | None, Health | None]:
    """The fleet's Redis as the operator reaches it, and why not when it cannot: (None, None) for a
    fleet without Redis (its router serves the spec's state from flags). Never raises."""
    meta = sdd["metadata"]
    redis = spec.get("redis") or {}
    if not redis:
        if default is None or not settings.default_redis_url:
            return None, None
        return default_target(default, meta["namespace"], meta["name"], meta.get("uid", "")), None
    if "url" in redis:
        return Target(redis["url"]), None
    ref = redis["secretRef"]
    secret_name, key = ref["name"], ref.get("key", "url")
    if not settings.read_redis_secrets:
        return None, Health(False, "NoCredentials", f"spec.redis.secretRef names Secret {secret_name}, which "
                            "this operator is not allowed to read (readRedisSecrets is off): the live state "
                            "is not written and the router serves the spec's state from its flags")
    try:
        secret = await kube.get("v1", "Secret", meta["namespace"], secret_name)
    except ApiError as exc:
        return None, Health(False, "NoCredentials", f"cannot read spec.redis.secretRef: {exc}")
    value = ((secret or {}).get("data") or {}).get(key)
    try:
        url = base64.b64decode(value).decode() if value else ""
    except (ValueError, UnicodeDecodeError):
        url = ""
    if not url:
        return None, Health(False, "NoCredentials", f"spec.redis.secretRef: Secret {secret_name} has no key "
                            f"{key!r} holding a redis:// URL")
    return Target(url), None


def fleet_secret(sdd: dict[str, Any], username: str, password: str) -> dict[str, Any]:
    """The Secret the fleet's pods read their Redis user from (manifests._redis_env)."""
    meta = sdd["metadata"]
    encode = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": manifests.redis_secret_name(meta["name"]), "namespace": meta["namespace"],
                         "labels": manifests.labels(meta["name"], component="redis", app="specfleet")},
            "data": {redis_auth.SECRET_USERNAME_KEY: encode(username), redis_auth.SECRET_PASSWORD_KEY: encode(password)}}


async def ensure_secret(kube: Any, secret: dict[str, Any], done: dict[tuple[str, ...], bool]) -> str | None:
    """Make the fleet's Secret hold its credentials: create it, or patch it when it is there (so
    the operator needs no `get` on Secrets); once per process and content (`done`). Returns an
    error to report, or None."""
    meta = secret["metadata"]
    mark = (meta["namespace"], meta["name"], *sorted(secret["data"].values()))
    if mark in done:
        return None
    try:
        try:
            await kube.create(secret)
        except ApiError as exc:
            if exc.status != 409:
                raise
            await kube.patch("v1", "Secret", meta["namespace"], meta["name"],
                             {"data": secret["data"], "metadata": {"ownerReferences": meta.get("ownerReferences")}})
    except ApiError as exc:
        return f"cannot write the fleet's Redis credentials: {exc}"
    done[mark] = True
    return None


class LiveStateStore:
    """Writes live-state documents, one Redis client per URL and login (one try per call,
    `timeout_s` each)."""

    def __init__(self, timeout_s: float = 2.0, retry_after_s: float = 5.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self.timeout_s, self.retry_after_s, self.clock, self.monotonic = timeout_s, retry_after_s, clock, monotonic
        self._clients: dict[tuple[str, str | None], Any] = {}
        self._failed_at: dict[str, float] = {}  # url -> when a call to it last failed
        self._url_health: dict[str, Health] = {}  # url -> what its last failed call met
        self._versions: dict[str, int] = {}  # key -> the last version this process wrote
        self._failing: set[str] = set()  # keys whose last write failed (log once per outage)
        self._users: set[tuple[str, str, str]] = set()  # (url, user, password) made to exist since the last failure
        self.written: dict[str, Health] = {}  # key -> what its last write met
        self.read: dict[str, Health] = {}  # key -> what the loop's last read of its windows met

    def _client(self, target: Target | str) -> Any:
        target = Target(target) if isinstance(target, str) else target
        if target.client_key() not in self._clients:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            self._clients[target.client_key()] = aioredis.from_url(
                target.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0, **target.credentials())
        return self._clients[target.client_key()]

    def health(self, namespace: str, name: str) -> Health | None:
        """What the fleet's Redis last showed: the last write's failure, else the last read's
        (the loop's windows), else ok; None before any try."""
        key = state_key(namespace, name)
        tries = [h for h in (self.written.get(key), self.read.get(key)) if h is not None]
        if not tries:
            return None
        return next((h for h in tries if not h.ok), tries[0])

    def note_read(self, target: Target, namespace: str, name: str, error: str | None) -> None:
        """Record what the loop's read of the fleet's windows met (`error`: the observation's)."""
        key = state_key(namespace, name)
        if error is None:
            self.read[key] = Health(True)
            return
        auth = error.split(":", 1)[0] in ("AuthenticationError", "NoPermissionError") or any(
            code in error for code in ("NOAUTH", "WRONGPASS", "NOPERM"))
        self.read[key] = Health(False, "AuthFailed" if auth else "Unreachable",
                                f"cannot read the fleet's windows at {redis_auth.where(target.url)}: {error}")

    async def _ensure_user(self, client: Any, target: Target, namespace: str, name: str) -> None:
        """The fleet's own user exists with its password and rules: set once per process and outage
        (a Redis that restarted lost it, and its first call failed, which forgets it here)."""
        if target.fleet_user is None:
            return
        username, password = target.fleet_user
        mark = (target.url, username, password)
        if mark in self._users and await client.execute_command("ACL", "GETUSER", username) is not None:
            return
        await client.execute_command(*redis_auth.setuser_args(namespace, name, password))
        self._users.add(mark)

    async def write(self, target: Target | str, namespace: str, name: str, wanted: LiveState) -> LiveState | None:
        """Make Redis hold `wanted` (its version and time are set here); returns the document Redis
        holds afterwards, or None when Redis could not be reached (`health` says why)."""
        target = Target(target) if isinstance(target, str) else target
        url = target.url
        key = state_key(namespace, name)
        if self.monotonic() - self._failed_at.get(url, -1e18) < self.retry_after_s:
            # it failed moments ago: do not make this fleet's status write wait again
            self.written[key] = self._url_health.get(url, Health(False, "Unreachable", ""))
            return None
        client = self._client(target)
        try:
            await self._ensure_user(client, target, namespace, name)
            raw = await client.get(key)
            try:
                stored = LiveState.from_json(raw) if raw is not None else None
            except ValueError as exc:  # someone wrote garbage: replace it
                log.warning("replacing an invalid live state", extra={"key": key, "error": str(exc)})
                stored = None
            if stored is not None and same_content(stored, wanted):
                self._versions[key] = max(self._versions.get(key, 0), stored.version)
                doc = stored
            else:
                version = max(stored.version if stored else 0, self._versions.get(key, 0)) + 1
                doc = dataclasses.replace(wanted, version=version, updated=self.clock())
                await client.set(key, doc.to_json())
                self._versions[key] = version
                log.info("live state written", extra={"key": key, "version": version,
                                                      "canary_weight": doc.canary_weight, "speculate": doc.speculate})
        except Exception as exc:  # redis.RedisError, OSError, timeouts: all mean "not now"
            if key not in self._failing:
                log.warning("could not write the live state to Redis; routers and workers keep their last "
                            "state until it can be written", extra={"key": key, "error": f"{type(exc).__name__}: {exc}"})
            self._failing.add(key)
            self._failed_at[url] = self.monotonic()
            self._users = {u for u in self._users if u[0] != url}
            health = Health(False, redis_auth.failure_reason(exc),
                            f"cannot write the live state to Redis at {redis_auth.where(url)}: "
                            f"{type(exc).__name__}: {exc}")
            self.written[key] = self._url_health[url] = health
            return None
        self._failed_at.pop(url, None)
        self.written[key] = Health(True, message=f"the live state is written to Redis at {redis_auth.where(url)}")
        if key in self._failing:
            log.info("live state written again after an outage", extra={"key": key, "version": doc.version})
            self._failing.discard(key)
        return doc

    async def delete(self, target: Target | str, namespace: str, name: str) -> bool:
        """Remove a deleted fleet's document, and its user; False when Redis could not be reached."""
        target = Target(target) if isinstance(target, str) else target
        key = state_key(namespace, name)
        self.written.pop(key, None)
        self.read.pop(key, None)
        try:
            client = self._client(target)
            await client.delete(key)
            if target.fleet_user is not None:
                await client.execute_command("ACL", "DELUSER", target.fleet_user[0])
                self._users = {u for u in self._users if u[1] != target.fleet_user[0]}
        except Exception as exc:
            log.warning("could not delete the live state", extra={"key": key, "error": f"{type(exc).__name__}: {exc}"})
            return False
        self._versions.pop(key, None)
        return True

    async def close(self) -> None:
        for client in self._clients.values():
            try:
                await client.aclose()
            except Exception:  # closing a connection to a Redis that is gone
                pass
        self._clients.clear()


class WindowSource:
    """The control loop's reads: a fleet's windows (workers per arm and prompt type, routers per
    cluster, drift pairs) in its Redis, one client per URL, one try per tick (`timeout_s` each).
    A failure is an incomplete observation (nothing is decided on it), never an exception."""

    def __init__(self, timeout_s: float = 2.0):
        self.timeout_s = timeout_s
        self._clients: dict[tuple[str, str | None], Any] = {}

    def _client(self, target: Target) -> Any:
        if target.client_key() not in self._clients:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._clients[target.client_key()] = redis.Redis.from_url(
                target.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0), **target.credentials())
        return self._clients[target.client_key()]

    async def observe(self, target: Target | str, namespace: str, name: str, arms: tuple[str, ...],
                      drift_epoch: str = ""):
        import asyncio

        from specfleet_control import observe

        target = Target(target) if isinstance(target, str) else target
        return await asyncio.to_thread(observe.read, self._client(target), namespace, name, arms, drift_epoch)

    def close(self) -> None:
        for client in self._clients.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a connection to a Redis that is gone
                pass
        self._clients.clear()
