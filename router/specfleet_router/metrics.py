"""The router's Prometheus metrics, under `specfleet_router_` with vLLM's names where vLLM has one
(`request_success`, `time_to_first_token_seconds`, `time_per_output_token_seconds`,
`e2e_request_latency_seconds`, `prompt_tokens`, `generation_tokens`). Each router owns its
registry, so two routers in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets for time to first token and time per output token
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

# what became of a request: the `outcome` label
OUTCOMES = ("ok", "invalid", "overloaded", "unavailable", "timeout", "cancelled", "error")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("specfleet_router_requests", "Requests by the arm that served them, prompt type, "
                                "draft method and outcome", ["arm", "prompt_type", "method", "outcome"], registry=r)
        self.request_success = Counter("specfleet_router_request_success", "Finished requests by finish reason "
                                       "(vLLM's request_success)", ["arm", "finish_reason"], registry=r)
        self.ttft = Histogram("specfleet_router_time_to_first_token_seconds", "Arrival at the router to the first "
                              "token", ["arm"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specfleet_router_time_per_output_token_seconds", "Time per output token after the "
                              "first", ["arm"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("specfleet_router_e2e_request_latency_seconds", "Arrival at the router to the last "
                             "token", ["arm"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specfleet_router_prompt_tokens", "Prompt tokens of finished requests",
                                     ["arm"], registry=r)
        self.generation_tokens = Counter("specfleet_router_generation_tokens", "Tokens generated", ["arm"],
                                         registry=r)
        self.retries = Counter("specfleet_router_retries", "Requests sent again to another backend before their "
                               "first token, by the gRPC status that caused it", ["arm", "reason"], registry=r)
        self.arm_fallbacks = Counter("specfleet_router_arm_fallbacks", "Requests served by the other arm because "
                                     "their own had no ready backend", ["from_arm", "to_arm"], registry=r)
        self.in_flight = Gauge("specfleet_router_requests_in_flight", "Requests the router is serving now",
                               registry=r)
        self.backend_ready = Gauge("specfleet_router_backend_ready", "1 when a backend's gRPC health says SERVING",
                                   ["arm", "backend"], registry=r)
        self.backend_outstanding = Gauge("specfleet_router_backend_outstanding_requests",
                                         "Requests in flight at a backend", ["arm", "backend"], registry=r)
        self.state_version = Gauge("specfleet_router_state_version", "Version of the live state (routing table) "
                                   "the router serves with", registry=r)
        self.canary_weight = Gauge("specfleet_router_canary_weight_percent", "The canary arm's share of requests "
                                   "in the live state", registry=r)
        self.redis_connected = Gauge("specfleet_router_redis_connected", "1 when the last read of the live state "
                                     "from Redis succeeded", registry=r)
        self.redis_staleness = Gauge("specfleet_router_redis_staleness_seconds", "Seconds since the live state was "
                                     "last read from Redis (0 without Redis)", registry=r)
        self.state_errors = Counter("specfleet_router_state_errors", "Failed reads of the live state, by reason "
                                    "(unreachable, invalid)", ["reason"], registry=r)
        self.probes = Counter("specfleet_router_probes", "Requests of a prompt type or cluster in fallback that "
                              "still speculated (the probes that keep it observed)", ["prompt_type"], registry=r)
        self.drift_pairs = Counter("specfleet_router_drift_pairs", "Mirrored pairs compared for the drift check, by "
                                   "kind (canary, control) and result (agree, differ; scored: a sampled pair)",
                                   ["kind", "result"], registry=r)
        self.drift_dropped = Counter("specfleet_router_drift_dropped", "Pairs the drift check did not mirror, by kind "
                                     "and reason (busy, no_backend, error)", ["kind", "reason"], registry=r)
        self.fleet_publish_errors = Counter("specfleet_router_fleet_publish_errors", "Failed writes of the cluster "
                                            "windows and drift counts to Redis", registry=r)
