"""Reconcile N SpecDecodeDeployments against the in-process emulator; report the time until all
are Ready, the operator's memory, and errors. The emulator shares the process, so the RSS
figures bound the operator's memory from above (its growth while reconciling is the closer one).

    .venv/bin/python operator/scripts/scale_test.py --count 100
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys
import time

import kmock
import kopf
import psutil

from specfleet_operator.kube import Kube
from specfleet_operator.testing import Cluster, OperatorThread, declare_resources, ready, sdd_body


class ErrorCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def main(count: int, timeout: float) -> int:
    errors = ErrorCounter()
    logging.getLogger().addHandler(errors)
    logging.getLogger().setLevel(logging.WARNING)
    proc = psutil.Process()
    async with Cluster() as cluster, kmock.Server(cluster):
        declare_resources(cluster)
        kube = Kube(kopf.ConnectionInfo(server=cluster.endpoint))
        op = OperatorThread(cluster.endpoint, "scale", leader_election=True, lease_duration=15).start()
        while not op.ready.is_set():
            await asyncio.sleep(0.05)
        rss_started = proc.memory_info().rss
        names = [f"fleet-{i:03d}" for i in range(count)]
        start = time.monotonic()
        for i, name in enumerate(names):
            spec = {"canary": {"weight": 5}} if i % 4 == 0 else {}
            await kube.create(sdd_body(name, **spec))
        created = time.monotonic() - start
        progress_at = 0
        while True:
            n_ready = sum(ready(cluster, n) for n in names)
            if n_ready >= progress_at + max(1, count // 10) or n_ready == count:
                print(f"  {n_ready:4d}/{count} Ready after {time.monotonic() - start:6.2f}s", flush=True)
                progress_at = n_ready
            if n_ready == count or time.monotonic() - start > timeout:
                break
            await asyncio.sleep(0.1)
        elapsed = time.monotonic() - start
        rss = proc.memory_info().rss
        await op.stop_and_join(30)
        await kube.close()
        deployments = len(cluster.all_live("apps/v1", "deployments"))
    print()
    print("| SDDs | created in | all Ready in | worker Deployments | process RSS | RSS growth while reconciling | "
          "max RSS | errors |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {count} | {created:.2f}s | {elapsed:.2f}s | {deployments} | {rss / 2**20:.0f} MiB | "
          f"+{(rss - rss_started) / 2**20:.0f} MiB | "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB | {len(errors.records)} |")
    for rec in errors.records[:5]:
        print("ERROR:", rec.getMessage()[:200])
    ok = n_ready == count and not errors.records and op.result == 0
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args()
    sys.exit(asyncio.run(main(a.count, a.timeout)))
