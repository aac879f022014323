"""`specfleet up`'s Redis is logged into, as in a cluster: an admin password in a 0600 file of the run
dir (never on a command line), the fleet's own user for the workers and the router (they publish
and follow through it), nothing for a client without credentials; and RedisServer's password alone."""
from __future__ import annotations

import importlib.util
import pathlib
import stat
import time

import psutil
import pytest
import redis

from specfleet_api import redis_auth
from specfleet_api.live_state import state_key, window_key
from specfleet_local.redis_server import RedisServer, run_credentials

_spec = importlib.util.spec_from_file_location("up_helpers", pathlib.Path(__file__).with_name("test_up.py"))
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)


def test_a_password_is_asked_and_never_on_the_command_line(tmp_path):
    with RedisServer(password="p" * 64) as server:
        assert "p" * 64 not in " ".join(psutil.Process(server.proc.pid).cmdline())
        with pytest.raises(redis.exceptions.AuthenticationError):
            server.client(password=None).get("x")
        assert server.client().ping()  # it logs in with the server's password
    with RedisServer(password="q" * 64, workdir=tmp_path) as server:
        conf = tmp_path / "redis.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and "q" * 64 in conf.read_text()


def test_up_logs_its_fleet_in_as_the_fleets_own_user(tmp_path):
    proc, run_file, out = helpers.up(tmp_path)
    try:
        doc = helpers.wait_serving(proc, run_file, out)
        secret = pathlib.Path(doc["redis"]["passwordFile"])
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        admin_pw = secret.read_text().strip()
        for pid in helpers.pids(doc).values():  # no password on any command line of the fleet
            assert admin_pw not in " ".join(psutil.Process(pid).cmdline())
        host, port = doc["redis"]["url"].removeprefix("redis://").split("/")[0].split(":")
        plain = redis.Redis(host=host, port=int(port), socket_timeout=2)
        with pytest.raises(redis.exceptions.AuthenticationError):
            plain.get(state_key("team-a", "tiny"))
        admin = redis.Redis(host=host, port=int(port), socket_timeout=2, **run_credentials(doc))
        user = admin.execute_command("ACL", "GETUSER", redis_auth.fleet_username("team-a", "tiny"))
        assert user is not None
        # the workers publish their windows as the fleet's user (they may write nothing else)
        end = time.monotonic() + 30
        while not list(admin.scan_iter(match=window_key("team-a", "tiny", "stable") + ":*")) and \
                not list(admin.scan_iter(match="specfleet:v1:team-a/tiny:worker:*")):
            assert time.monotonic() < end, "no worker published as the fleet's user"
            time.sleep(0.2)
        fleet_pw = (pathlib.Path(doc["workdir"]) / "redis-fleet.password").read_text().strip()
        assert stat.S_IMODE((pathlib.Path(doc["workdir"]) / "redis-fleet.password").stat().st_mode) == 0o600
        fleet = redis.Redis(host=host, port=int(port), socket_timeout=2,
                            username=redis_auth.fleet_username("team-a", "tiny"), password=fleet_pw)
        assert fleet.get(state_key("team-a", "tiny")) is not None
        with pytest.raises(redis.exceptions.NoPermissionError):
            fleet.set(state_key("team-a", "tiny"), "{}")
    finally:
        helpers.stop(proc)
