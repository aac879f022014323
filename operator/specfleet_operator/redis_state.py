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
before it writes, and the Secret its pods read it from.

The operator may only create Secrets: it never reads, patches or deletes one (docs/redis.md,
"Credentials"). So a fleet's credentials are never edited in place: they live in an immutable Secret
named after them (`credentials_name`: a name only the master secret's holder can know before it
exists), owned by a ConfigMap of the same name (its handle, owned by the fleet). New credentials (the
admin password rotated) make a new pair, the pods' secretKeyRefs move to it (so they roll), the
Redis user accepts both passwords until the fleet is Ready again, and then the old handle is deleted,
which garbage collection follows to the old Secret. An existing handle that is not the fleet's, or a
Secret found where its handle had to be created, is left as it is and reported (ChildOwnedByAnother).
Redis' ACL LOG tells which fleets' pods hold credentials it refuses (`LiveStateStore.auth_failures`).
"""
from __future__ import annotations

import base64
import dataclasses
import logging
import time
from typing import Any, Callable

from specfleet_api import redis_auth
from specfleet_api.live_state import LiveState, state_key

from . import GROUP, manifests
from .kube import ApiError, controller_of

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


@dataclasses.dataclass
class DefaultRedis:
    """The fleets' default Redis: its URL (no password in it) and its admin password, also the
    master secret each fleet's password is derived from (redis_auth.fleet_password). With
    `password_file` (a mounted Secret key, which the kubelet rewrites when the Secret changes) the
    password is the file's as of the last `refresh`: a rotation reaches every fleet's credentials.
    """

    url: str
    password: str = dataclasses.field(default="", repr=False)
    password_file: str | None = None

    def refresh(self) -> bool:
        """Read the password file again; whether the password changed. A file that cannot be read
        keeps the last password (logged): Redis still takes it, or the next status says so."""
        if not self.password_file:
            return False
        try:
            new = redis_auth.read_secret_file(self.password_file)
        except (OSError, ValueError) as exc:
            log.warning("cannot read the Redis password file, keeping the last password",
                        extra={"file": self.password_file, "error": str(exc)})
            return False
        changed, self.password = new != self.password, new
        if changed:
            log.info("the Redis admin password changed: each fleet gets new credentials", extra={"url": self.url})
        return changed


AUTH_FAILURE_WINDOW_S = 120.0  # failed logins this recent mean a pod holds credentials Redis refuses now


@dataclasses.dataclass(frozen=True)
class AuthFailures:
    """Failed logins as a fleet's user (Redis' ACL LOG): how many (as Redis counts them: a client's
    retries each count) and from which addresses (the pods)."""

    count: int = 0
    addresses: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a fleet's documents go and how the operator logs in there; `fleet_user` (username,
    password): the fleet's own user, made to exist before each first write."""

    url: str
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    fleet_user: tuple[str, str] | None = dataclasses.field(default=None, repr=False)

    def client_key(self) -> tuple[str, str | None, str | None]:
        """One client per URL and login: a rotated password gets a client of its own."""
        return self.url, self.username, redis_auth.password_hash(self.password) if self.password else None

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
                            "this operator does not read (the chart's router.readRedisSecrets is off): the live "
                            "state is not written and the router serves the spec's state from its flags; or "
                            "drop spec.redis to use the install's Redis")
    try:
        secret = await kube.get("v1", "Secret", meta["namespace"], secret_name)
    except ApiError as exc:
        if exc.status == 403:  # the chart grants no read of any Secret: the namespace's owner grants this one
            return None, Health(False, "NoCredentials", f"the operator may not read Secret {secret_name} of "
                                f"spec.redis.secretRef: grant it get on that one Secret, e.g. `kubectl -n "
                                f"{meta['namespace']} create role specfleet-read-{secret_name} --verb=get "
                                f"--resource=secrets --resource-name={secret_name}` and a RoleBinding of that "
                                f"Role to the operator's ServiceAccount (docs/redis.md)")
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


CREDENTIALS_LABEL = f"{GROUP}/redis-credentials"  # the fleet's label value, on the handle and the Secret


def credentials_name(sdd_name: str, username: str, password: str) -> str:
    """The name of the fleet's credentials Secret and of its handle ConfigMap."""
    return manifests.redis_secret_name(sdd_name, redis_auth.credentials_digest(username, password))


def credentials_objects(sdd: dict[str, Any], username: str, password: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(handle ConfigMap owned by the fleet, immutable Secret to be owned by the handle): the pair
    that holds one set of the fleet's credentials. The Secret's owner reference needs the handle's
    uid, which `ensure_credentials` fills in."""
    meta = sdd["metadata"]
    name = credentials_name(meta["name"], username, password)
    labels = {**manifests.labels(meta["name"], component="redis", app="specfleet"),
              CREDENTIALS_LABEL: manifests.label_value(meta["name"])}
    encode = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731
    handle = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels,
                           "ownerReferences": [manifests.owner_reference(sdd)]},
              "data": {"secret": name, "purpose": "deleting this ConfigMap deletes the Secret of the same name "
                       "(the fleet's Redis credentials) through garbage collection"}}
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
              "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels},
              "data": {redis_auth.SECRET_USERNAME_KEY: encode(username), redis_auth.SECRET_PASSWORD_KEY: encode(password)}}
    return handle, secret


@dataclasses.dataclass(frozen=True)
class CredentialsResult:
    """What `ensure_credentials` met: `error` (an API error to report and retry) or `taken` (an
    object in the way that is not the fleet's, left alone), or neither."""

    error: str | None = None
    taken: str | None = None


FOREIGN_SECRET = f"{GROUP}/secret-not-ours"  # on a handle whose Secret was found made by someone else


async def ensure_credentials(kube: Any, sdd: dict[str, Any], username: str, password: str,
                             done: dict[tuple[str, ...], bool]) -> CredentialsResult:
    """Make the fleet's credentials Secret exist: create its handle, then the Secret; never read,
    patch or delete a Secret. Once per process and credentials (`done`).

    The handle is created first, so a Secret already there when its handle was not is someone
    else's: the handle is marked (FOREIGN_SECRET) and the Secret left alone until it is gone."""
    meta = sdd["metadata"]
    handle, secret = credentials_objects(sdd, username, password)
    ns, name = meta["namespace"], handle["metadata"]["name"]
    mark = (ns, name, meta.get("uid") or "")
    if mark in done:
        return CredentialsResult()
    foreign = CredentialsResult(taken=f"Secret {name} exists, but not as this operator creates it (its handle "
                                      f"ConfigMap did not exist): left as it is; delete it to let the operator "
                                      "write the fleet's Redis credentials there")
    try:
        try:
            live = await kube.create(handle)
            fresh = True
        except ApiError as exc:
            if exc.status != 409:
                raise
            live, fresh = await kube.get("v1", "ConfigMap", ns, name), False
            if live is None:
                return CredentialsResult(error=f"ConfigMap {name} vanished while being created: will retry")
            owner = controller_of(live)
            if owner is None or owner.get("uid") != meta.get("uid"):
                who = f"{owner.get('kind')} {owner.get('name')} (uid {owner.get('uid')})" if owner else "no controller"
                return CredentialsResult(taken=f"ConfigMap {name} (the handle of the fleet's Redis credentials) is "
                                               f"controlled by {who}, not by this resource: left as it is")
        marked = FOREIGN_SECRET in ((live.get("metadata") or {}).get("annotations") or {})
        secret["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": name,
                                                  "uid": live["metadata"]["uid"], "controller": True,
                                                  "blockOwnerDeletion": False}]
        try:
            await kube.create(secret)
        except ApiError as exc:
            if exc.status != 409:
                raise
            if fresh:
                await kube.patch("v1", "ConfigMap", ns, name, {"metadata": {"annotations": {FOREIGN_SECRET: "true"}}})
            if fresh or marked:
                return foreign
        else:
            if marked:  # the foreign Secret is gone and ours is in its place
                await kube.patch("v1", "ConfigMap", ns, name, {"metadata": {"annotations": {FOREIGN_SECRET: None}}})
    except ApiError as exc:
        return CredentialsResult(error=f"cannot write the fleet's Redis credentials: {exc}")
    done[mark] = True
    return CredentialsResult()


async def retire_credentials(kube: Any, sdd: dict[str, Any], current: str | None) -> list[str]:
    """Delete the handles of the fleet's credentials other than `current` (garbage collection takes
    their Secrets); the names deleted."""
    meta = sdd["metadata"]
    found = await kube.list("v1", "ConfigMap", meta["namespace"],
                            label_selector=f"{CREDENTIALS_LABEL}={manifests.label_value(meta['name'])}")
    gone = []
    for cm in found:
        name = cm["metadata"]["name"]
        owner = controller_of(cm)
        if name != current and owner is not None and owner.get("uid") == meta.get("uid"):
            await kube.delete("v1", "ConfigMap", meta["namespace"], name)
            gone.append(name)
    return gone


class LiveStateStore:
    """Writes live-state documents, one Redis client per URL and login (one try per call,
    `timeout_s` each)."""

    def __init__(self, timeout_s: float = 2.0, retry_after_s: float = 5.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, auth_window_s: float = AUTH_FAILURE_WINDOW_S):
        self.timeout_s, self.retry_after_s, self.clock, self.monotonic = timeout_s, retry_after_s, clock, monotonic
        self.auth_window_s = auth_window_s  # failed logins this recent count (auth_failures)
        self._clients: dict[tuple[str, str | None, str | None], Any] = {}
        self._failed_at: dict[str, float] = {}  # url -> when a call to it last failed
        self._url_health: dict[str, Health] = {}  # url -> what its last failed call met
        self._versions: dict[str, int] = {}  # key -> the last version this process wrote
        self._failing: set[str] = set()  # keys whose last write failed (log once per outage)
        self._users: set[tuple[str, str, str]] = set()  # (url, user, password) made to exist since the last failure
        self._acl_logs: dict[str, tuple[float, list[dict[str, Any]]]] = {}  # url -> (when read, ACL LOG)
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
        (a Redis that restarted lost it, and its first call failed, which forgets it here). New
        credentials keep the user's other passwords valid (pods still rolling away from the old
        Secret) until `retire_passwords`."""
        if target.fleet_user is None:
            return
        username, password = target.fleet_user
        mark = (target.url, username, password)
        user = await client.acl_getuser(username)
        if mark in self._users and user is not None:
            return
        current = redis_auth.password_hash(password)
        keep = tuple(h for h in (user or {}).get("passwords", []) if h != current)
        await client.execute_command(*redis_auth.setuser_args(namespace, name, password, keep))
        self._users.add(mark)

    async def retire_passwords(self, target: Target, namespace: str, name: str) -> bool | None:
        """Leave the fleet's user only its current password (its pods all hold the current Secret);
        whether a password was dropped, None when Redis could not be asked. Never raises."""
        if target.fleet_user is None:
            return False
        username, password = target.fleet_user
        try:
            client = self._client(target)
            user = await client.acl_getuser(username)
            if user is None or set(user.get("passwords", [])) <= {redis_auth.password_hash(password)}:
                return False
            await client.execute_command(*redis_auth.setuser_args(namespace, name, password))
        except Exception as exc:  # redis.RedisError, OSError, timeouts
            log.warning("could not retire a fleet's old Redis password", extra={"user": username, "error": str(exc)})
            return None
        return True

    async def auth_failures(self, target: Target) -> AuthFailures | None:
        """Failed logins as the fleet's own user whose latest came within `auth_window_s` (Redis'
        ACL LOG, read as the admin, at most once per `retry_after_s` per Redis); None when unknown."""
        within_s = self.auth_window_s
        if target.fleet_user is None:
            return None
        url = target.url
        cached = self._acl_logs.get(url)
        if cached is None or self.monotonic() - cached[0] >= self.retry_after_s:
            try:
                entries = await self._client(target).acl_log()
            except Exception:  # the write's health says what is wrong with this Redis
                return None
            cached = self._acl_logs[url] = (self.monotonic(), entries)
        username = target.fleet_user[0]
        hits = [e for e in cached[1] if e.get("reason") == "auth" and e.get("username") == username
                and float(e.get("age-seconds", 1e18)) <= within_s]
        addrs = sorted({str((e.get("client-info") or {}).get("addr", "?")).rsplit(":", 1)[0] for e in hits})
        return AuthFailures(sum(int(e.get("count", 1)) for e in hits), tuple(addrs))

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
        self._clients: dict[tuple[str, str | None, str | None], Any] = {}

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
