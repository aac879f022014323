"""`specfleet canary pause|resume|promote|abort NAME [-n NS]`, also the kubectl plugin
`kubectl specfleet canary ...`: sets the manual gate, the annotation serving.specfleet.dev/canary,
on a SpecDecodeDeployment (docs/canary.md). The operator's canary analysis acts on it at its next
tick: pause holds the run while set, resume lifts it, promote and abort end it. Talks to the API
server with the kubernetes client and the kubeconfig (or the pod's service account); with
`--local`, to the fleet `specfleet up` runs on this machine (its run file names its Redis, where
the gate is a key the local loop reads).
"""
from __future__ import annotations

import argparse
import os
import sys

from specfleet_control.canary import GATE_ANNOTATION, GATES
from specfleet_operator import GROUP, KIND, PLURAL, VERSION

WHAT = {"pause": "holds the run (no step, no abort) while the annotation says pause",
        "resume": "lifts a pause", "promote": "promotes the canary now", "abort": "aborts the canary now (weight 0)"}


class GateError(Exception):
    """Something the user can act on; the message says what."""


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Set a SpecDecodeDeployment's canary gate "
                                f"(the {GATE_ANNOTATION} annotation); the operator acts on it at its next tick.")
    p.add_argument("gate", choices=GATES, help="; ".join(f"{g}: {w}" for g, w in WHAT.items()))
    p.add_argument("name", help="the SpecDecodeDeployment")
    p.add_argument("-n", "--namespace", default=None, help="its namespace (default: the kubeconfig context's)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    p.add_argument("--local", action="store_true", help="the fleet `specfleet up` runs on this machine, not a cluster")
    p.add_argument("--run-file", default=None, help="with --local: up's run file (default: as `specfleet status`)")
    return p


def set_local_gate(run_file: str | None, name: str, gate: str) -> tuple[str | None, str]:
    """Write the gate where the local loop reads it; (the value it had, the canary's phase)."""
    import json
    from pathlib import Path

    import redis

    from specfleet_local import runfile
    from specfleet_local.redis_server import run_credentials
    from specfleet_local.state import gate_key, loop_key

    path = Path(run_file) if run_file else runfile.default_path()
    doc = runfile.running(path)
    if doc is None:
        raise GateError(f"no `specfleet up` is running (no live run file at {path})")
    namespace, _, running = doc["deployment"].partition("/")
    if running != name:
        raise GateError(f"the local fleet is {doc['deployment']}, not {name}")
    client = redis.Redis.from_url(doc["redis"]["url"], socket_timeout=2, **run_credentials(doc))
    try:
        loop = json.loads(client.get(loop_key(namespace, name)) or "{}")
        if not loop.get("canary"):
            raise GateError(f"{doc['deployment']} has no canary running a loop (no spec.canary, or --no-loop)")
        before = client.get(gate_key(namespace, name))
        client.set(gate_key(namespace, name), gate)
    except redis.RedisError as e:
        raise GateError(f"cannot reach the local fleet's Redis: {e}") from None
    finally:
        client.close()
    return (before.decode() if before else None), loop["canary"].get("phase", "Idle")


def _client(kubeconfig: str | None, context: str | None) -> tuple[object, str]:
    """(CustomObjectsApi, the context's namespace) from the kubeconfig, else the pod's service account."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
        _, active = config.list_kube_config_contexts(config_file=kubeconfig)
        if context:
            contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
            active = next(c for c in contexts if c["name"] == context)
        namespace = (active.get("context") or {}).get("namespace") or "default"
    except (ConfigException, FileNotFoundError, StopIteration) as e:
        if kubeconfig or context:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise GateError(f"cannot load the kubeconfig {where}: {e}") from None
        try:
            config.load_incluster_config()
        except ConfigException:
            raise GateError(f"no kubeconfig ({e}) and not in a pod: set --kubeconfig or $KUBECONFIG") from None
        namespace = "default"
    return client.CustomObjectsApi(), namespace


def set_gate(api, namespace: str, name: str, gate: str) -> tuple[str | None, str]:
    """Patch the annotation; (the value it had, the canary's phase in the status). GateError when
    the resource is missing, has no canary, or the API server refuses."""
    from kubernetes.client.exceptions import ApiException

    what = f"{KIND} {namespace}/{name}"
    try:
        sdd = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        if not (sdd.get("spec") or {}).get("canary"):
            raise GateError(f"{what} has no spec.canary: there is no canary to {gate}")
        before = ((sdd.get("metadata") or {}).get("annotations") or {}).get(GATE_ANNOTATION)
        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                           {"metadata": {"annotations": {GATE_ANNOTATION: gate}}})
    except ApiException as e:
        if e.status == 404:
            raise GateError(f"{what} not found (is the CRD installed, and is the namespace right?)") from None
        if e.status in (401, 403):
            raise GateError(f"not allowed to read or patch {what}: {e.reason}") from None
        raise GateError(f"the API server refused: {e.status} {e.reason}") from None
    return before, ((sdd.get("status") or {}).get("canary") or {}).get("phase", "Idle")


def main(argv: list[str] | None = None, prog: str = "specfleet canary") -> int:
    args = _parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    if args.local:
        try:
            before, phase = set_local_gate(args.run_file, args.name, args.gate)
        except GateError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 1
        print(f"local fleet {args.name}: canary {args.gate} requested (the run is {phase})")
        return 0
    try:
        import urllib3

        api, namespace = _client(args.kubeconfig, args.context)
        namespace = args.namespace or namespace
        try:
            before, phase = set_gate(api, namespace, args.name, args.gate)
        except urllib3.exceptions.HTTPError as e:
            raise GateError(f"cannot reach the API server: {e}") from None
    except GateError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    again = " (it already said so: the operator acts on a change)" if before == args.gate and args.gate in (
        "promote", "abort") else ""
    print(f"{PLURAL[:-1]}.{GROUP}/{args.name}: canary {args.gate} requested "
          f"({GATE_ANNOTATION}={args.gate}; the run is {phase}){again}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
