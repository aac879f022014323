"""Who may do what in a fleet's Redis (docs/redis.md): the per-fleet ACL user, its password and the
environment its clients read their credentials from. Torch-free; the operator, `specfleet up`, the
router and the worker all import it, so a rule or a derivation has one home.

A fleet's routers and workers share one Redis user, `specfleet:<namespace>:<name>`, whose password is
HMAC-SHA256(master secret, "<namespace>/<name>/<uid>"): whoever holds the master secret (the operator,
`specfleet up`) derives it again and never needs to read it back. The user may only READ its fleet's
live state (the loop writes it) and read and write its own windows, summaries, cluster windows and
drift counts; no other key, no other command.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from typing import Any, Mapping
from urllib.parse import urlsplit

from .live_state import PREFIX, state_key

URL_ENV = "SPECFLEET_REDIS_URL"  # never holds a password: a URL is logged and shown
USERNAME_ENV = "SPECFLEET_REDIS_USERNAME"
PASSWORD_ENV = "SPECFLEET_REDIS_PASSWORD"  # from a secretKeyRef, never a plain value in a manifest
PASSWORD_FILE_ENV = "SPECFLEET_REDIS_PASSWORD_FILE"  # or a mounted file holding it
#: The keys of the per-fleet Secret the operator creates (and the pods' secretKeyRefs name).
SECRET_USERNAME_KEY, SECRET_PASSWORD_KEY = "username", "password"
#: Each client's own keys under its fleet's prefix: written by the workers (window, worker) and the
#: routers (clusters, drift), read back by the loop.
OWN_KEYS = ("window", "worker", "clusters", "drift")
#: Everything the fleet's routers and workers send: reads of the state, hashes written in a
#: transaction with a time to live, deleted when a pod leaves. ACL rules apply the key patterns.
COMMANDS = ("get", "hset", "hgetall", "expire", "pexpire", "del", "exists", "multi", "exec", "discard", "ping",
            "select")  # select: a URL may name a database other than 0


#: A Redis URL that carries a password (the CRD's CEL rule on spec.redis.url says the same; a test
#: holds the rule to this regex): in the user info, where urllib and redis-py find one (a `:` before
#: the last `@` of the authority: `redis://user:pass@host`, `redis://:pass@host`), or in the query
#: (`?password=`, which redis-py reads too). A URL is logged, shown and a plain value in every pod
#: template; a bare user name (`redis://user@host`, an ACL user without a password) holds no secret.
URL_WITH_PASSWORD = r"^rediss?://[^/?#]*:[^/?#]*@|[?&]password="


def url_has_password(url: Any) -> bool:
    """Whether a Redis URL carries a password (URL_WITH_PASSWORD).

    >>> [url_has_password(u) for u in ("redis://:s3cret@r:6379/0", "rediss://app:s3cret@r", "redis://r/0?password=s")]
    [True, True, True]
    >>> [url_has_password(u) for u in ("redis://r:6379/0", "redis://app@r:6379", "redis://[::1]:6379", None)]
    [False, False, False, False]
    """
    return isinstance(url, str) and re.search(URL_WITH_PASSWORD, url) is not None


def fleet_username(namespace: str, name: str) -> str:
    """The fleet's Redis user.

    >>> fleet_username("default", "chat")
    'specfleet:default:chat'
    """
    return f"specfleet:{namespace}:{name}"


def fleet_password(master: str | bytes, namespace: str, name: str, uid: str) -> str:
    """The fleet's password: 64 hex digits that only the master secret's holder can derive. The uid
    makes a fleet deleted and created again under the same name a new user with a new password.

    >>> fleet_password("m", "default", "chat", "u1") == fleet_password(b"m", "default", "chat", "u1")
    True
    >>> fleet_password("m", "default", "chat", "u1") != fleet_password("m", "default", "chat", "u2")
    True
    """
    if not master:
        raise ValueError("the master secret is empty")
    key = master.encode() if isinstance(master, str) else master
    return hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).hexdigest()


def credentials_digest(username: str, password: str) -> str:
    """10 hex digits of the credentials, which name the fleet's Secret: only the master secret's
    holder can name it before it exists, and new credentials get a new Secret (never an edit).

    >>> len(credentials_digest("specfleet:default:chat", "p")), credentials_digest("u", "p") != credentials_digest("u", "q")
    (10, True)
    """
    return hashlib.sha256(f"{username}\n{password}".encode()).hexdigest()[:10]


def password_hash(password: str) -> str:
    """The password as Redis' ACL keeps it (`ACL GETUSER`'s passwords, `#<hash>` in `ACL SETUSER`).

    >>> password_hash("foo")[:12]
    '2c26b46b68ff'
    """
    return hashlib.sha256(password.encode()).hexdigest()


def _glob_escape(text: str) -> str:
    r"""A literal in a Redis glob pattern.

    >>> _glob_escape("a*b?[c]")
    'a\\*b\\?\\[c\\]'
    """
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def fleet_acl(namespace: str, name: str) -> list[str]:
    """The ACL rules of the fleet's user (after `reset`): read-only on its live state, read and
    write on its own keys, the commands of COMMANDS and no other.

    >>> fleet_acl("default", "chat")[:3]
    ['-@all', '+get', '+hset']
    >>> [r for r in fleet_acl("default", "chat") if "~" in r][:2]
    ['%R~specfleet:v1:default/chat:state', '~specfleet:v1:default/chat:window:*']
    """
    base = _glob_escape(f"{PREFIX}{namespace}/{name}")
    return (["-@all", *(f"+{c}" for c in COMMANDS), "resetchannels",
             f"%R~{_glob_escape(state_key(namespace, name))}"]
            + [f"~{base}:{kind}:*" for kind in OWN_KEYS])


def setuser_args(namespace: str, name: str, password: str, keep: tuple[str, ...] = ()) -> list[str]:
    """`ACL SETUSER` arguments that make the user exactly this (reset first: nothing else stays).
    `keep`: password hashes (password_hash) that stay valid beside `password`: the credentials of
    pods still rolling away from a rotated Secret.

    >>> setuser_args("default", "chat", "p", keep=("ab12",))[3:7]
    ['reset', 'on', '>p', '#ab12']
    """
    return ["ACL", "SETUSER", fleet_username(namespace, name), "reset", "on", f">{password}",
            *(f"#{h}" for h in keep), *fleet_acl(namespace, name)]


def read_secret_file(path: str) -> str:
    """A password kept in a file (a mounted Secret key, `specfleet up`'s run dir): its first line.
    OSError / ValueError naming the file when it cannot be used."""
    with open(path, encoding="utf-8") as f:
        value = f.read().strip()
    if not value:
        raise ValueError(f"{path}: the Redis password file is empty")
    return value


def write_secret_file(path: str | os.PathLike, value: str) -> None:
    """Write a password to a file only its owner may read (0600 from its creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of other modes
        f.write(value + "\n")


def credentials_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """redis-py's `username` / `password` keyword arguments from the environment: the username from
    SPECFLEET_REDIS_USERNAME, the password from SPECFLEET_REDIS_PASSWORD or the file named by
    SPECFLEET_REDIS_PASSWORD_FILE; {} when neither is set (a Redis without auth, or a URL that
    carries its own).

    >>> credentials_from_env({"SPECFLEET_REDIS_USERNAME": "u", "SPECFLEET_REDIS_PASSWORD": "p"})
    {'username': 'u', 'password': 'p'}
    >>> credentials_from_env({})
    {}
    """
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    if env.get(USERNAME_ENV):
        out["username"] = env[USERNAME_ENV]
    if env.get(PASSWORD_ENV):
        out["password"] = env[PASSWORD_ENV]
    elif env.get(PASSWORD_FILE_ENV):
        out["password"] = read_secret_file(env[PASSWORD_FILE_ENV])
    return out


def where(url: str) -> str:
    """The URL's host and port, for a message: never its user or password.

    >>> where("redis://:secret@redis.specfleet-system:6379/0"), where("rediss://u:p@[::1]:7000")
    ('redis.specfleet-system:6379', '[::1]:7000')
    """
    parts = urlsplit(url)
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port or 6379}"


def failure_reason(exc: BaseException) -> str:
    """What a Redis error means to a user: AuthFailed (wrong or missing credentials, a command or
    key the user may not touch) or Unreachable (anything else: refused, timed out, paused, read-only).

    >>> import redis
    >>> failure_reason(redis.AuthenticationError("invalid username-password pair")), failure_reason(OSError())
    ('AuthFailed', 'Unreachable')
    >>> failure_reason(redis.ResponseError("NOAUTH Authentication required."))
    'AuthFailed'
    """
    from redis import exceptions as errors

    if isinstance(exc, (errors.AuthenticationError, errors.NoPermissionError)):
        return "AuthFailed"
    if isinstance(exc, errors.ResponseError) and str(exc).split(" ", 1)[0] in ("NOAUTH", "NOPERM", "WRONGPASS"):
        return "AuthFailed"
    return "Unreachable"
