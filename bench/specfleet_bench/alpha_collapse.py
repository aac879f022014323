"""An alpha-collapse episode on a real local fleet: `specfleet up` (Redis, a worker, the router,
the control loop), the official openai client as the traffic, Redis read every second.

Two prompt types speculate with n-gram drafts (translation and math by default: Spec-Bench
questions the router classifies as `translation` and `math`; translation copies names and numbers
from its prompt, so its drafts are accepted often). Phases:

    warm      both types greedy: the loop learns each type's baseline alpha (with --until-evidence,
              until the first type's rests on --baseline-tokens drafted tokens)
    collapse  the first type's traffic turns to sampling at a high temperature (1.5): its outputs
              stop following the prompt and the n-gram drafts stop being accepted (alpha moves
              with the temperature); that type must fall back alone
    recover   it is greedy again: its probes see alpha back, speculation returns
    cluster   (--cluster) it stays greedy, and one more client sends it out-of-distribution requests
              (Finnish to translate, sampled at temperature 1.5): that prompt cluster falls back alone

With --until-evidence each phase lasts until what it is there to show has happened (the loop
learned both baselines; the type fell back and enough of its requests ran in fallback; the type
and its clusters are back; the OOD cluster fell back and requests followed), at least its seconds
and at most --phase-limit: on a slow machine the loop waits for evidence (thin windows add up), so
fixed phases would end before it has any. A phase that reaches its limit ends the episode, and
`missing` says what the loop still lacked (the collapsed type's drafted tokens against what a miss
needs at that alpha, the loop's own reason). Each fallback is also timed from when the loop first
held the evidence it needed (the key's pending evidence plus its current window, judged as the loop
judges them).

It prints and writes (JSON, and a plot with --plot) how long each fallback took in seconds and
windows, the transitions per key, the errors, the other type's mode, and the collapsed type's
throughput in fallback against plain decoding, two ways: priced by the cost model (its windows'
plain-equivalent / busy seconds) and measured in place (tokens/s of all its requests against its
plain, non-probe requests of the same phase).

    python -m specfleet_bench.alpha_collapse --plot docs/bench/alpha-collapse.png --out docs/bench/alpha-collapse.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specfleet_api.live_state import LiveState, state_key
from specfleet_api.windows import read_cluster_windows, read_windows
from specfleet_control import loop as slo_loop
from specfleet_control.slo import FALLBACK, MISSED, SPECULATIVE, Evidence, KeyState, SloPolicy, judge
from specfleet_local.state import loop_key
from specfleet_router.classify import classify

from .local_fleet import local_fleet
from .questions import default_questions, load_questions

NAME, NAMESPACE = "collapse", "default"


FINNISH = ["Järvenpään kaupunginvaltuusto käsitteli tiistaina {n} talousarviota, ja keskustelu venyi myöhään "
           "illalla.", "Pohjois-Karjalan metsäsuunnitelma {n} hyväksyttiin yksimielisesti, vaikka "
           "kuulemistilaisuus kesti pitkään.", "Äänestysprosentti nousi {n} prosenttiyksikköä edellisistä "
           "kunnallisvaaleista, kertoo oikeusministeriön tilastokatsaus.", "Rovaniemen lentoaseman matkustajamäärä "
           "kasvoi {n} prosenttia joulukuussa, kun turistit saapuivat Lappiin."]


def ood_prompt(rng: random.Random) -> str:
    """Out-of-distribution text inside the translation type: Finnish (the type's traffic is
    German), sampled hot: its outputs follow nothing the drafts could copy."""
    return "Translate Finnish to English: " + rng.choice(FINNISH).format(n=rng.randrange(2, 99))


def spec(model: str, window_s: float, dwell_s: float, recover_s: float, probe_share: float,
         quantization: str = "none", engine: str = "specfleet") -> dict:
    """The episode's fleet. With engine vllm: an n-gram pool (a fixed K 4, as vLLM drafts) and the
    plain pool, one vLLM server each, on the bundled model (`specfleet up` exports it)."""
    doc = _spec(model, window_s, dwell_s, recover_s, probe_share, quantization)
    if engine == "vllm":
        s = doc["spec"]
        s["engine"] = {"name": "vllm"}
        s["model"] = {"name": "smollm2-135m", "uri": "smollm2-135m-instruct", "source": {"pvc": {"claimName": "hf"}}}
        s["speculation"] = {"kPolicy": "fixed", "kInitial": 4, "kMax": 4}
        del s["quantization"]
    return doc


def _spec(model: str, window_s: float, dwell_s: float, recover_s: float, probe_share: float,
          quantization: str = "none") -> dict:
    return {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"},
                     "draft": {"method": "ngram"}, "speculation": {"kMin": 0, "kMax": 6, "kInitial": 3},
                     "quantization": quantization, "replicas": 1,
                     "slo": {"window": f"{int(window_s * 1000)}ms", "minDraftTokens": 50,
                             "fallback": {"probeShare": probe_share, "minDwell": f"{int(dwell_s * 1000)}ms",
                                          "recoverAfter": f"{int(recover_s * 1000)}ms",
                                          "clusters": {"minRequests": 4}}}}}


@dataclass
class Call:
    start: float
    end: float
    prompt_type: str
    phase: str
    tokens: int = 0
    probe: bool = False
    method: str = ""
    cluster: str = ""
    ood: bool = False
    error: str = ""


@dataclass
class Sample:
    t: float
    version: int
    fallback: list[str]
    clusters: list[str]
    alpha: dict[str, float | None]
    speedup: dict[str, float | None]
    plain_ratio: dict[str, float | None]  # type's plain-equivalent / busy seconds over its window
    cluster_alpha: dict[str, float | None] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)  # the loop's reason per key
    # per key (type:..., cluster:...): what the loop would judge now, its pending evidence plus the
    # current window: drafted and accepted tokens, requests seen, and whether that is a miss
    evidence: dict[str, dict] = field(default_factory=dict)
    baselines: dict[str, float] = field(default_factory=dict)
    baseline_tokens: dict[str, int] = field(default_factory=dict)  # drafted tokens behind each baseline


def share(e: Evidence, fraction: float) -> Evidence:
    """A fraction of a window's evidence (its counts scaled, rounded), one window still."""
    return Evidence(**{f: (round(v * fraction) if isinstance(v, int) else v * fraction)
                       for f, v in asdict(e).items() if f != "windows"}, windows=e.windows)


def would_miss(e: Evidence, state: KeyState, policy: SloPolicy, cluster: bool) -> bool:
    """Whether the loop, judging this evidence for a speculating key, would call it a miss."""
    sample = slo_loop.cluster_sample(e, policy) if cluster else slo_loop.sample_of(e)
    return judge(sample, KeyState(SPECULATIVE, baseline=state.baseline), policy)[0] == MISSED


def drafted_needed(alpha: float, state: KeyState, policy: SloPolicy, cluster: bool, most: int = 5000) -> int | None:
    """The fewest drafted tokens at this alpha that the loop would judge a miss (None: none up to `most`).

    >>> drafted_needed(0.0, KeyState(baseline=0.7), SloPolicy(), cluster=True)  # 0 of 15: under 0.35 at 95%
    15
    """
    n = 1
    while n <= most:
        e = Evidence(draft_tokens=n, accepted_tokens=round(alpha * n), requests=policy.cluster_min_requests,
                     seen=policy.cluster_min_requests, windows=1)
        if would_miss(e, state, policy, cluster):
            return n
        n += 1 if n < 64 else n // 8
    return None


class Episode:
    def __init__(self, args):
        self.args = args
        self.calls: list[Call] = []
        self.samples: list[Sample] = []
        self.sample_error = ""  # what the sampler last met reading Redis, if it failed
        self.events: list[dict] = []
        self.phase = "warm"
        self.t0 = 0.0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        qs = load_questions(Path(args.questions) if args.questions else default_questions())
        by_type: dict[str, list[str]] = {}
        for q in qs:
            if len(q["turns"][0]) <= args.max_prompt_chars:
                by_type.setdefault(classify(q["turns"][0]).value, []).append(q["turns"][0])
        self.kinds = (args.type, args.other)
        self.prompts = {t: by_type.get(t, [])[:24] for t in self.kinds}
        assert all(len(p) >= 4 for p in self.prompts.values()), {t: len(p) for t, p in by_type.items()}
        self.policy = SloPolicy.from_spec(spec(args.model, args.window, args.dwell, args.recover_after,
                                               args.probe_share, args.quantization, args.engine)["spec"])
        self.loop_doc: dict = {}
        self.missing: str | None = None  # what the loop still lacked when a phase reached its limit

    # -- traffic ------------------------------------------------------------------------------

    def client_loop(self, openai_url: str, prompt_type: str, seed: int, ood_client: bool = False) -> None:
        import openai

        client = openai.OpenAI(base_url=openai_url, api_key="none", timeout=120, max_retries=0)
        rng = random.Random(seed)
        n = 0
        while not self.stop.is_set():
            phase = self.phase
            mine = prompt_type == self.args.type
            ood = ood_client
            if ood and phase != "cluster":
                self.stop.wait(0.2)
                continue
            if ood:
                prompt, temperature = ood_prompt(rng), self.args.ood_temperature
            else:
                prompt = rng.choice(self.prompts[prompt_type])
                temperature = self.args.temperature if (mine and phase == "collapse") else 0.0
            n += 1
            call = Call(time.monotonic() - self.t0, 0.0, prompt_type, phase, ood=ood)
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=NAME, messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.args.max_tokens, temperature=temperature, seed=rng.randrange(2**31))
                r = raw.parse()
                call.tokens = r.usage.completion_tokens
                call.probe = raw.headers.get("x-specfleet-probe") == "1"
                call.method = raw.headers.get("x-specfleet-method", "")
                call.cluster = raw.headers.get("x-specfleet-cluster", "")
                got = raw.headers.get("x-specfleet-prompt-type")
                if got != prompt_type and not ood:
                    call.error = f"classified {got}"
            except Exception as e:  # noqa: BLE001 - every failure is counted, none may happen
                call.error = f"{type(e).__name__}: {e}"
                self.stop.wait(0.2)
            call.end = time.monotonic() - self.t0
            with self.lock:
                self.calls.append(call)

    # -- observing ------------------------------------------------------------------------------

    def sampler(self, run: dict) -> None:
        import redis

        from specfleet_local.redis_server import run_credentials

        client = redis.Redis.from_url(run["redis"]["url"], socket_timeout=2, **run_credentials(run))
        while not self.stop.is_set():
            try:
                state = LiveState.from_json(client.get(state_key(NAMESPACE, NAME)))
                windows = read_windows(client, NAMESPACE, NAME, ("stable",)).get("stable", {})
                clusters = read_cluster_windows(client, NAMESPACE, NAME)
                loop = json.loads(client.get(loop_key(NAMESPACE, NAME)) or "{}")
                self.events = loop.get("events", self.events)
                self.loop_doc = loop
                memory = slo_loop.Memory.from_status(loop.get("memory"))
                current = {slo_loop.type_key(t): slo_loop.window_evidence(w) for t, w in windows.items()}
                current.update({slo_loop.cluster_key(c): slo_loop.cluster_evidence(cw) for c, cw in clusters.items()
                                if slo_loop.judges_cluster(memory.keys, slo_loop.cluster_key(c), cw)})
                # the loop's next judgement adds what came since its last to the evidence it kept (a
                # share of the current window: the rest was judged), and its half-way check judges
                # the current window alone
                since = 1.0 if memory.judged_at is None else \
                    min(1.0, max(0.0, (time.time() - memory.judged_at) / self.policy.window_s))
                evidence = {}
                for key, window in current.items():
                    held = memory.keys.get(key, KeyState())
                    if window is None or held.mode == FALLBACK:
                        continue
                    e = slo_loop.still_pending(memory.evidence.get(key), self.policy).plus(share(window, since))
                    cluster = key.startswith("cluster:")
                    evidence[key] = {"draft_tokens": e.draft_tokens, "accepted_tokens": e.accepted_tokens,
                                     "seen": e.seen, "miss": would_miss(e, held, self.policy, cluster)
                                     or would_miss(window, held, self.policy, cluster)}
                self.samples.append(Sample(
                    t=time.monotonic() - self.t0, version=state.version, fallback=list(state.fallback),
                    clusters=list(state.fallback_clusters),
                    alpha={t: w.alpha for t, w in windows.items()},
                    speedup={t: w.spec_speedup for t, w in windows.items()},
                    plain_ratio={t: w.speedup for t, w in windows.items()},
                    cluster_alpha={c: cw.alpha for c, cw in clusters.items()},
                    why={k: v.get("reason", "") for k, v in ((loop.get("memory") or {}).get("keys") or {}).items()},
                    evidence=evidence,
                    baselines={k: st.baseline for k, st in memory.keys.items() if st.baseline is not None},
                    baseline_tokens={k: st.baseline_tokens or 0 for k, st in memory.keys.items()
                                     if st.baseline is not None}))
            except Exception as e:  # noqa: BLE001 - a missed sample is a gap in the plot
                self.sample_error = f"{type(e).__name__}: {e}"
                print(f"sampler: {self.sample_error}", file=sys.stderr)
            self.stop.wait(1.0)

    def run(self) -> dict:
        a = self.args
        with tempfile.TemporaryDirectory(prefix="specfleet-collapse-") as tmp, local_fleet(
                spec(a.model, a.window, a.dwell, a.recover_after, a.probe_share, a.quantization, a.engine), Path(tmp),
                loop_period=a.loop_period, worker_threads=a.worker_threads, max_batch=a.max_batch, model=a.model,
                ready_timeout=a.ready_timeout, engine=a.engine,
                name="collapse") as doc:
            self.t0 = time.monotonic()
            threads = [threading.Thread(target=self.sampler, args=(doc,), daemon=True)]
            for t, n in ((a.type, a.clients), (a.other, a.other_clients or a.clients)):
                for i in range(n):
                    threads.append(threading.Thread(target=self.client_loop,
                                                    args=(doc["router"]["openai"], t, 17 * i + len(t)),
                                                    daemon=True))
            if a.cluster:
                for i in range(a.ood_clients):
                    threads.append(threading.Thread(target=self.client_loop,
                                                    args=(doc["router"]["openai"], a.type, 1000 + i, True),
                                                    daemon=True))
            for th in threads:
                th.start()
            schedule = [("warm", a.warm), ("collapse", a.collapse), ("recover", a.recover_phase)]
            if a.cluster:
                schedule.append(("cluster", a.cluster_phase))
            self.phases = {}
            for phase, seconds in schedule:
                self.phase = phase
                start = time.monotonic() - self.t0
                self.phases[phase] = (round(start, 2), None)
                if not a.until_evidence:
                    print(f"[{start:6.1f}s] phase {phase} for {seconds:.0f}s", flush=True)
                    self.stop.wait(seconds)
                else:
                    print(f"[{start:6.1f}s] phase {phase}: at least {seconds:.0f}s, until its evidence "
                          f"(at most {a.phase_limit:.0f}s x the fleet's slowness, now {self.stretch():.2f})",
                          flush=True)
                    missing = self.wait_for_evidence(phase, start, seconds, a.phase_limit)
                self.phases[phase] = (self.phases[phase][0], round(time.monotonic() - self.t0, 2))
                if a.until_evidence and missing:
                    ran = self.phases[phase][1] - start
                    tps = self.fleet_tps()
                    self.missing = (f"phase {phase} ran {ran:.0f}s (its limit {a.phase_limit:.0f}s x "
                                    f"{self.stretch():.2f}: the fleet served "
                                    f"{'no' if tps is None else f'{tps:.0f}'} tokens/s against the "
                                    f"{a.reference_tps:g} the limit is sized for) without its evidence: {missing}")
                    print(f"[{time.monotonic() - self.t0:6.1f}s] {self.missing}", flush=True)
                    break
            self.stop.set()
            for th in threads:
                th.join(timeout=a.max_tokens * 2 + 60)
        return self.report()

    # -- phases sized by evidence ---------------------------------------------------------------

    def fleet_tps(self) -> float | None:
        """Tokens/s the fleet has served its clients so far (all of them, finished requests)."""
        done = self._calls(lambda c: c.end and not c.error)
        elapsed = time.monotonic() - self.t0
        return sum(c.tokens for c in done) / elapsed if done and elapsed > 0 else None

    def stretch(self) -> float:
        """How much longer than --phase-limit a phase may run on this machine: the evidence a phase
        needs comes in tokens, so a fleet serving fewer tokens/s than --reference-tps gathers it that
        much more slowly (1 until a request has finished; at most --max-stretch)."""
        tps = self.fleet_tps()
        if not tps:
            return 1.0
        return min(self.args.max_stretch, max(1.0, self.args.reference_tps / tps))

    def wait_for_evidence(self, phase: str, start: float, least_s: float, limit_s: float) -> str | None:
        """Waits until `phase` has shown what it is for (and at least least_s); None then, else
        (at limit_s x stretch()) what the loop still lacked."""
        while True:
            now = time.monotonic() - self.t0
            missing = self.lacking(phase, start)
            if missing is None and now - start >= least_s:
                return None
            if now - start >= limit_s * self.stretch():
                return missing or "nothing (its minimum outlasted the limit)"
            self.stop.wait(1.0)

    def _calls(self, pred) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if pred(c)]

    def _key(self, key: str) -> tuple[KeyState, str]:
        raw = ((self.loop_doc.get("memory") or {}).get("keys") or {}).get(key) or {}
        return KeyState.from_status(raw), raw.get("reason", "no judgement yet")

    def _clusters_of(self, prompt_type: str, ood: bool = False) -> set[str]:
        return {c.cluster for c in self._calls(lambda c: c.prompt_type == prompt_type and c.ood == ood and c.cluster)}

    def evidence_note(self, key: str, since: float) -> str:
        """What the loop holds for a speculating key and what a miss needs at its alpha."""
        state, why = self._key(key)
        seen = [smp.evidence[key] for smp in self.samples if smp.t >= since and key in smp.evidence]
        if not seen:
            return f"{key}: no window since {since:.0f}s (the loop: {why})"
        e = seen[-1]
        alpha = e["accepted_tokens"] / e["draft_tokens"] if e["draft_tokens"] else None
        need = drafted_needed(alpha, state, self.policy, key.startswith("cluster:")) if alpha is not None else None
        line = (f"{1 - self.policy.alpha_drop:.2g} x its baseline {state.baseline:.3f}" if state.baseline is not None
                else f"the floor {self.policy.alpha_floor}")
        held = f"{key}'s windows held {e['draft_tokens']} drafted tokens"
        if alpha is None:
            return f"{held} (no alpha yet; the loop: {why})"
        need_s = f"the loop needs {need}" if need is not None else "no amount would do"
        return (f"{held} at alpha {alpha:.3f} over {e['seen']} requests; {need_s} at that alpha to call it under "
                f"{line} (the loop: {why})")

    def lacking(self, phase: str, start: float) -> str | None:
        """None once `phase` has shown what it is for, else what is still missing."""
        a, T, O = self.args, self.args.type, self.args.other
        last = self.samples[-1] if self.samples else None
        if last is None:
            return "no sample of Redis yet" + (f" (the last try: {self.sample_error})" if self.sample_error else "")
        if phase == "warm":
            # the collapse is judged against the type's baseline: one thin first window is not a
            # settled one (the other type only needs one: it must keep speculating)
            lacking = []
            for k in (slo_loop.type_key(T), slo_loop.type_key(O)):
                if k not in last.baselines:
                    lacking.append(f"{k} has no baseline yet (the loop: {self._key(k)[1]}; a baseline needs a "
                                   f"healthy window of at least minDraftTokens {self.policy.min_draft_tokens} "
                                   f"drafted tokens)")
                elif k == slo_loop.type_key(T) and last.baseline_tokens.get(k, 0) < a.baseline_tokens:
                    lacking.append(f"{k}'s baseline {last.baselines[k]:.3f} rests on {last.baseline_tokens.get(k, 0)} "
                                   f"drafted tokens of healthy windows, not yet {a.baseline_tokens}")
            return "; ".join(lacking) or None
        if phase == "collapse":
            entered = self._first(start, lambda smp: T in smp.fallback)
            if entered is None:
                return "the collapsed type never fell back: " + self.evidence_note(slo_loop.type_key(T), start)
            after = self._calls(lambda c: c.prompt_type == T and not c.ood and c.start >= entered and c.end
                                and not c.error)
            probes = sum(c.probe for c in after)
            if len(after) < a.fallback_requests or not probes or probes == len(after) \
                    or last.t < entered + a.window + 1:
                return (f"{len(after)} of its requests finished in fallback ({probes} probes) over "
                        f"{last.t - entered:.0f}s; the measurement needs {a.fallback_requests}, probes and plain ones, "
                        f"over a window ({a.window:g}s)")
            return None
        if phase == "recover":
            held = [f"type:{T}"] if T in last.fallback else []
            held += [f"cluster:{c}" for c in last.clusters if c in self._clusters_of(T)]
            if held:
                return "still in fallback: " + "; ".join(f"{k} (the loop: {self._key(k)[1]})" for k in held)
            return None
        if phase == "cluster":
            ood = self._clusters_of(T, ood=True)
            entered = self._first(start, lambda smp: bool(set(smp.clusters) & ood))
            if entered is None:
                notes = [self.evidence_note(slo_loop.cluster_key(c), start) for c in sorted(ood)]
                calls = self._calls(lambda c: c.ood and c.start >= start and c.end and not c.error)
                methods = collections.Counter(c.method for c in calls)
                # what the OOD requests were (a thin window is either few drafts or few tokens)
                seen = (f"; its {len(calls)} requests made {sum(c.tokens for c in calls) / max(1, len(calls)):.1f} "
                        f"tokens each, methods {dict(methods)}, {sum(c.probe for c in calls)} probes; "
                        f"{slo_loop.type_key(T)}: {self._key(slo_loop.type_key(T))[1]}")
                return "no out-of-distribution cluster fell back: " + ("; ".join(notes) + seen if notes
                                                                       else "no OOD request finished")
            plain = self._calls(lambda c: c.ood and c.start > entered + 1 and c.end and not c.probe)
            normal = self._calls(lambda c: not c.ood and c.prompt_type == T and c.start > entered and c.end)
            if len(plain) < 2 or len(normal) < 2:
                return (f"after the fallback, {len(plain)} OOD requests ran plain and {len(normal)} of the type's "
                        f"own finished; 2 of each are needed")
            return None
        return None

    # -- results ---------------------------------------------------------------------------------

    def _first(self, since: float, pred) -> float | None:
        return next((s.t for s in self.samples if s.t >= since and pred(s)), None)

    def report(self) -> dict:
        a, ph = self.args, self.phases
        T, O = a.type, a.other
        # an episode that stopped at a phase's limit has no later phases: nothing after it is found
        last_t = self.samples[-1].t if self.samples else 0.0
        never = (math.inf, math.inf)
        collapse_at, recover_at = ph.get("collapse", never)[0], ph.get("recover", never)[0]
        recover_end = ph.get("recover", (None, last_t))[1]
        entered = self._first(collapse_at, lambda s: T in s.fallback)
        key = slo_loop.type_key(T)
        evidence_at = self._first(collapse_at, lambda s: (s.evidence.get(key) or {}).get("miss") or T in s.fallback)
        left = self._first(recover_at, lambda s: T not in s.fallback) if entered and recover_at is not None else None
        transitions: dict[str, list[str]] = {}
        for prev, cur in zip(self.samples, self.samples[1:]):
            for t in set(prev.fallback) ^ set(cur.fallback):
                transitions.setdefault(f"type:{t}", []).append("enter" if t in cur.fallback else "leave")
            for c in set(prev.clusters) ^ set(cur.clusters):
                transitions.setdefault(f"cluster:{c}", []).append("enter" if c in cur.clusters else "leave")
        in_fallback = [c for c in self.calls if c.prompt_type == T and entered is not None
                       and c.start >= entered and c.end <= (left if left is not None else recover_end)]
        plain = [c for c in in_fallback if not c.probe and not c.error]
        rate = lambda cs: sum(c.tokens for c in cs) / sum(c.end - c.start for c in cs) if cs else None
        priced = [s.plain_ratio.get(T) for s in self.samples
                  if entered is not None and s.t >= entered + a.window and T in s.fallback
                  and s.plain_ratio.get(T) is not None]
        chat_modes = {p: sorted({("fallback" if O in s.fallback else "speculative") for s in self.samples
                                 if ph[p][0] <= s.t <= ph[p][1]}) for p in ph}
        out = {
            "model": a.model, "type": T, "other_type": O, "collapse_temperature": a.temperature, "window_s": a.window, "min_dwell_s": a.dwell, "recover_after_s": a.recover_after,
            "probe_share_pct": a.probe_share, "clients_per_type": a.clients, "max_tokens": a.max_tokens,
            "phases": ph,
            "requests": len(self.calls), "errors": [asdict(c) for c in self.calls if c.error][:3],
            "error_count": sum(1 for c in self.calls if c.error),
            "fallback_after_s": None if entered is None else round(entered - collapse_at, 2),
            "fallback_after_windows": None if entered is None else round((entered - collapse_at) / a.window, 2),
            # from when the loop first held the evidence a miss needs (pending + current window)
            "evidence_after_s": None if evidence_at is None else round(evidence_at - collapse_at, 2),
            "fallback_after_evidence_windows": None if entered is None or evidence_at is None
            else round(max(0.0, entered - evidence_at) / a.window, 2),
            "missing": self.missing,
            "fleet_tokens_per_s": self.fleet_tps(), "phase_limit_stretch": round(self.stretch(), 3),
            "recovered_after_s": None if left is None else round(left - recover_at, 2),
            "transitions": transitions,
            "other_type_modes_by_phase": chat_modes,
            # why the other type fell back, if it did: its speculation priced below plain decoding
            # (a loaded machine) is the loop at work; its alpha collapsing with the type's would not be
            "other_type_fallbacks": [e["message"].split(": ", 1)[1] for e in self.events
                                     if e["reason"] == "FallbackEntered"
                                     and e["message"].startswith(f"prompt type {O}: ")],
            "type_requests_in_fallback": len(in_fallback), "type_probes_in_fallback": sum(c.probe for c in in_fallback),
            "fallback_vs_plain_measured": (round(rate([c for c in in_fallback if not c.error]) / rate(plain), 3)
                                           if plain and rate(plain) else None),
            "fallback_vs_plain_priced": round(sum(priced) / len(priced), 3) if priced else None,
            "loop_events": self.events,
        }
        if a.cluster:
            cl = ph.get("cluster", never)[0]
            ood_clusters = {c.cluster for c in self.calls if c.ood and c.cluster}
            own = {c.cluster for c in self.calls if not c.ood and c.cluster and c.prompt_type == T}
            entered_c = self._first(cl, lambda s: bool(set(s.clusters) & ood_clusters))
            keys = {slo_loop.cluster_key(c) for c in ood_clusters}
            evidence_c = self._first(cl, lambda s: any((s.evidence.get(k) or {}).get("miss") for k in keys)
                                     or bool(set(s.clusters) & ood_clusters))
            in_fallback_c = sorted({c for s in self.samples if s.t >= cl for c in s.clusters})
            out["cluster"] = {
                "ood_clusters": sorted(ood_clusters),
                "fallback_after_s": None if entered_c is None else round(entered_c - cl, 2),
                "evidence_after_s": None if evidence_c is None else round(evidence_c - cl, 2),
                "fallback_after_evidence_windows": None if entered_c is None or evidence_c is None
                else round(max(0.0, entered_c - evidence_c) / a.window, 2),
                "clusters_in_fallback": in_fallback_c,
                # the in-distribution clusters of the OOD's own type (its usual traffic), and any
                # other cluster (the other type's), each judged on its own evidence
                "type_clusters_in_fallback": sorted(set(in_fallback_c) & (own - ood_clusters)),
                "other_clusters_in_fallback": sorted(set(in_fallback_c) - own - ood_clusters),
                "type_modes": sorted({("fallback" if T in s.fallback else "speculative")
                                           for s in self.samples if s.t >= cl}),
                "normal_request_methods_after": sorted({c.method for c in self.calls
                                               if c.phase == "cluster" and not c.ood and c.prompt_type == T
                                               and entered_c is not None and c.start > entered_c}),
                "ood_methods_after": sorted({c.method for c in self.calls if c.ood and entered_c is not None
                                             and c.start > entered_c + 1 and not c.probe}),
            }
        out["timeline"] = [asdict(s) for s in self.samples]
        out["calls"] = [asdict(c) for c in self.calls]
        return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    t = [s["t"] for s in tl]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    kinds = (result["type"], result["other_type"])
    for typ, color in zip(kinds, ("tab:red", "tab:blue")):
        axes[0].plot(t, [s["alpha"].get(typ) for s in tl], color=color, label=f"alpha {typ} (window)")
        axes[1].step(t, [1 if typ in s["fallback"] else 0 for s in tl], where="post", color=color,
                     label=f"{typ} in fallback")
    if any(s["clusters"] for s in tl):
        axes[1].step(t, [0.5 * bool(s["clusters"]) for s in tl], where="post", color="tab:purple",
                     label=f"a {kinds[0]} prompt cluster in fallback")
    calls = result["calls"]
    for typ, color in zip(kinds, ("tab:red", "tab:blue")):
        xs, ys = [], []
        for s in range(0, int(max(t) if t else 0) + 1, 2):
            done = [c for c in calls if c["prompt_type"] == typ and s <= c["end"] < s + 4 and not c["error"]]
            xs.append(s + 2)
            ys.append(sum(c["tokens"] for c in done) / 4.0)
        axes[2].plot(xs, ys, color=color, label=f"{typ} tokens/s (4 s bins)")
    for ax in axes:
        for name, (start, _end) in result["phases"].items():
            ax.axvline(start, color="grey", lw=0.8, ls="--")
            if ax is axes[0]:
                ax.text(start, 1.02, name, transform=ax.get_xaxis_transform(), fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
    axes[0].set_ylabel("alpha")
    axes[1].set_ylabel("mode (1 = fallback)")
    axes[2].set_ylabel("tokens/s")
    axes[2].set_xlabel("seconds")
    fig.suptitle(f"alpha collapse on {result['model']}: window {result['window_s']}s, probe "
                 f"{result['probe_share_pct']}%, fallback after {result['fallback_after_s']}s, "
                 f"back {result['recovered_after_s']}s after good traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specfleet_bench.alpha_collapse", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny-random")
    p.add_argument("--quantization", default="none",
                   help="the workers' weights: none (fp32, the default) or int8. With the fused decoder step an "
                        "int8 step is cheap enough that n-gram drafts pay little at a few clients and the "
                        "policy drafts rarely, so a healthy type's evidence gathers slowly")
    p.add_argument("--engine", choices=("specfleet", "vllm"), default="specfleet",
                   help="the workers: specfleet's (default) or vLLM servers, an n-gram pool and the plain pool "
                        "(vLLM's CPU build: ./dev setup --vllm)")
    p.add_argument("--type", default="translation", help="the prompt type that collapses (default translation)")
    p.add_argument("--other", default="math", help="the prompt type that stays healthy (default math)")
    p.add_argument("--temperature", type=float, default=1.5, help="the collapsed traffic's temperature (default 1.5)")
    p.add_argument("--window", type=float, default=10.0, help="slo.window in seconds (default 10)")
    p.add_argument("--dwell", type=float, default=10.0, help="fallback.minDwell in seconds (default 10)")
    p.add_argument("--recover-after", type=float, default=20.0, help="fallback.recoverAfter, seconds (default 20)")
    p.add_argument("--probe-share", type=float, default=10.0, help="fallback.probeShare, percent (default 10)")
    p.add_argument("--loop-period", type=float, default=1.0)
    p.add_argument("--warm", type=float, default=40.0, help="seconds of good traffic first (default 40)")
    p.add_argument("--collapse", type=float, default=60.0, help="seconds of collapsed code traffic (default 60)")
    p.add_argument("--recover-phase", type=float, default=70.0, help="seconds of good traffic after (default 70)")
    p.add_argument("--cluster", action="store_true", help="then a phase with an out-of-distribution code cluster")
    p.add_argument("--cluster-phase", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=2, help="concurrent clients of the collapsing type (default 2)")
    p.add_argument("--other-clients", type=int, default=1, help="concurrent clients of the other type (default 1)")
    p.add_argument("--ood-clients", type=int, default=1,
                   help="clients that send out-of-distribution requests of the type in the cluster phase (default 1)")
    p.add_argument("--ood-temperature", type=float, default=1.5, help="their temperature (default 1.5)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--worker-threads", type=int, default=2)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--questions", default=None)
    p.add_argument("--max-prompt-chars", type=int, default=800, help="leave longer questions out (default 800)")
    p.add_argument("--until-evidence", action="store_true",
                   help="each phase lasts until it has shown what it is for (at least its seconds, at most "
                        "--phase-limit); on a limit the episode stops and says what the loop lacked")
    p.add_argument("--phase-limit", type=float, default=300.0,
                   help="seconds, with --until-evidence, on a fleet serving --reference-tps (default 300)")
    p.add_argument("--reference-tps", type=float, default=200.0,
                   help="the fleet's tokens/s (all clients) --phase-limit is sized for: a slower fleet's phases "
                        "may run longer by as much (default 200, a 2-core AVX-512 machine)")
    p.add_argument("--max-stretch", type=float, default=5.0,
                   help="at most this many times --phase-limit, however slow the fleet (default 5)")
    p.add_argument("--baseline-tokens", type=int, default=200,
                   help="with --until-evidence, the warm phase lasts until the collapsing type's baseline rests on "
                        "this many drafted tokens of healthy windows (default 200)")
    p.add_argument("--fallback-requests", type=int, default=6,
                   help="with --until-evidence, the collapsed type's requests that finish in fallback before it "
                        "recovers (default 6)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = Episode(args).run()
    summary = {k: v for k, v in result.items() if k not in ("timeline", "calls", "loop_events")}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
