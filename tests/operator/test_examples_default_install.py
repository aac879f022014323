"""Every file in deploy/examples/ (by glob: a new one is covered), applied to an operator started as
the chart's default install starts it (its rendered args and env: the built-in Redis with a
password, no read of any Secret, every namespace), against a real redis-server: each served one
becomes Ready with Degraded and Stalled False and its live state in Redis; one that cannot be
served is held at Ready False, workerless, saying which value to set."""
import dataclasses
import pathlib

import helm_python as helm
import yaml

from specfleet_operator import API_VERSION
from specfleet_operator.main import parse_args
from specfleet_operator.testing import EXAMPLE_VERDICTS, OperatorThread, stored_live_state, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
ADMIN = "chart-generated-password"


def chart_default_container():
    out = helm.Chart.load(str(ROOT / "charts" / "specfleet")).render({}, name="specfleet", namespace="specfleet-system",
                                                                     is_install=True)
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (operator,) = [d for d in docs if d["kind"] == "Deployment"]
    return operator["spec"]["template"]["spec"]["containers"][0]


def conditions(cluster, name):
    sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", name) or {}
    return {c["type"]: c for c in (sdd.get("status") or {}).get("conditions", [])}


def healthy(cluster, name):
    conds = conditions(cluster, name)
    return all(conds.get(t, {}).get("status") == want
               for t, want in (("Ready", "True"), ("Degraded", "False"), ("Stalled", "False"), ("RedisReady", "True")))


def refused(cluster, name):
    ready = conditions(cluster, name).get("Ready", {})
    return ready.get("status") == "False" and ready.get("reason") in ("Unsupported", "InvalidSpec") and \
        "spec." in ready.get("message", "")


async def test_every_example_is_ready_on_a_default_install(cluster, kube, redis_server, tmp_path):
    container = chart_default_container()
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env.get("SPECFLEET_REDIS_URL") and env.get("SPECFLEET_REDIS_PASSWORD_FILE"), env  # the built-in Redis
    args = container["args"]
    assert "--read-redis-secrets" not in args and not [a for a in args if a.startswith("--namespace")], args
    # that Redis, here: a real server asking for the password the operator reads from its file
    redis_server.client().config_set("requirepass", ADMIN)
    (tmp_path / "password").write_text(ADMIN)
    chart = parse_args(args + ["--redis-url", redis_server.url, "--redis-password-file", str(tmp_path / "password")])
    op = OperatorThread(cluster.endpoint, "op-a", leader_election=chart.leader_election)
    op.options = dataclasses.replace(op.options, worker=chart.worker, namespaces=chart.namespaces,
                                     redis_url=chart.redis_url, redis_password_file=chart.redis_password_file)

    verdicts = {}
    for path in EXAMPLES:
        assert path.stem in EXAMPLE_VERDICTS, f"say in testing.EXAMPLE_VERDICTS whether {path.name} is served"
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "SpecDecodeDeployment":
                await kube.create(doc)
                verdicts[doc["metadata"]["name"]] = EXAMPLE_VERDICTS[path.stem]
    assert len(verdicts) >= len(EXAMPLES)
    served = [n for n, v in verdicts.items() if v == "served"]
    rejected = [n for n, v in verdicts.items() if v != "served"]
    op.start()
    try:
        # 1.5 s for all six on a shared 2-core box: 60 s holds on a CPU four times slower, and more examples
        await wait_for(lambda: all(healthy(cluster, n) for n in served) and all(refused(cluster, n) for n in rejected),
                       60, "every served example Ready and healthy, every other one refused")
        admin = redis_server.client(password=ADMIN)
        for name in served:
            assert stored_live_state(admin, "default", name) is not None, name
        deployments = {d["metadata"]["name"] for d in cluster.all_live("apps/v1", "deployments")}
        assert not [d for n in rejected for d in deployments if d.startswith(f"{n}--")], deployments
    except AssertionError:
        for name in verdicts:
            print(name, {t: (c["status"], c["reason"], c["message"]) for t, c in conditions(cluster, name).items()})
        raise
    finally:
        await op.stop_and_join()
