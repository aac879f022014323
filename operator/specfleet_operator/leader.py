"""Leader election on a coordination.k8s.io Lease, as client-go does it: one replica holds the
Lease and renews it; the others retry, and take it once it has not been renewed for
leaseDurationSeconds. Updates carry resourceVersion, so two candidates cannot both win.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any, Callable

from .kube import ApiError, Kube

logger = logging.getLogger("specfleet.leader")


def _parse(ts: str | None) -> float | None:
    if not ts:
        return None
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def _format(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def verdict(lease_spec: dict[str, Any], identity: str, now: float) -> str:
    """What a candidate may do with a Lease: "renew" it, "acquire" it, or "wait".
    >>> verdict({"holderIdentity": "a", "renewTime": "2024-01-01T00:00:00.000000Z",
    ...          "leaseDurationSeconds": 15}, "b", now=1704067210.0)
    'wait'
    """
    holder = lease_spec.get("holderIdentity")
    if holder == identity:
        return "renew"
    if not holder:
        return "acquire"
    renewed = _parse(lease_spec.get("renewTime")) or _parse(lease_spec.get("acquireTime")) or 0.0
    return "acquire" if now >= renewed + lease_spec.get("leaseDurationSeconds", 15) else "wait"


class LeaseElector:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *, duration_s: float = 15.0,
                 renew_s: float = 5.0, retry_s: float = 2.0, clock: Callable[[], float] = time.time):
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration_s, self.renew_s, self.retry_s, self.clock = duration_s, renew_s, retry_s, clock

    def _spec(self, now: float, acquired: bool, transitions: int) -> dict[str, Any]:
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.duration_s)),
                "renewTime": _format(now)}
        if acquired:
            spec.update(acquireTime=_format(now), leaseTransitions=transitions)
        return spec

    async def try_once(self) -> bool:
        """One attempt to acquire or renew; True while this candidate holds the Lease."""
        now = self.clock()
        lease = await self.kube.get("coordination.k8s.io/v1", "Lease", self.namespace, self.name)
        if lease is None:
            try:
                await self.kube.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                        "metadata": {"name": self.name, "namespace": self.namespace},
                                        "spec": self._spec(now, True, 0)})
                return True
            except ApiError as exc:
                if exc.status == 409:
                    return False
                raise
        spec = lease.get("spec", {})
        action = verdict(spec, self.identity, now)
        if action == "wait":
            return False
        patch = {"metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
                 "spec": self._spec(now, action == "acquire", spec.get("leaseTransitions", 0) + 1)}
        try:
            await self.kube.patch("coordination.k8s.io/v1", "Lease", self.namespace, self.name, patch)
        except ApiError as exc:
            if exc.status == 409:  # someone else wrote it first
                return False
            raise
        if action == "acquire":
            logger.info("%s acquired the lease %s/%s", self.identity, self.namespace, self.name)
        return True

    async def acquire(self) -> None:
        """Return once this candidate is the leader."""
        while True:
            try:
                if await self.try_once():
                    return
            except (ApiError, OSError, asyncio.TimeoutError) as exc:
                logger.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            await asyncio.sleep(self.retry_s)

    async def hold(self) -> None:
        """Renew until the Lease is lost (taken, or not renewed in time); then return."""
        last_ok = self.clock()
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                ok = await self.try_once()
            except (ApiError, OSError, asyncio.TimeoutError) as exc:
                logger.warning("lease renewal failed: %s", exc)
                ok = False
            if ok:
                last_ok = self.clock()
            elif self.clock() - last_ok >= self.duration_s - self.retry_s:
                logger.error("%s lost the lease %s/%s", self.identity, self.namespace, self.name)
                return

    async def release(self) -> None:
        """Give the Lease up at once (on a clean shutdown) so a standby need not wait it out."""
        lease = await self.kube.get("coordination.k8s.io/v1", "Lease", self.namespace, self.name)
        if lease and lease.get("spec", {}).get("holderIdentity") == self.identity:
            try:
                await self.kube.patch("coordination.k8s.io/v1", "Lease", self.namespace, self.name, {
                    "metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1}})
            except ApiError as exc:
                logger.warning("lease release failed: %s", exc)
