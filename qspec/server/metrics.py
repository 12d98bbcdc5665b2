"""Prometheus metrics of `qspec serve` (GET /metrics), in a registry of the server's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("qspec_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge("qspec_queue_depth", "generation requests waiting for the worker", registry=r)
        self.running = Gauge("qspec_requests_running", "generation requests being generated (batched together)", registry=r)
        self.prompt_tokens = Counter("qspec_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_prompt_tokens = Counter("qspec_cached_prompt_tokens",
                                            "prompt tokens whose KV rows were reused instead of prefilled",
                                            registry=r)
        self.generated_tokens = Counter("qspec_generated_tokens", "tokens generated", registry=r)
        self.drafted_tokens = Counter("qspec_drafted_tokens", "tokens drafted by the MX draft", registry=r)
        self.accepted_tokens = Counter("qspec_accepted_tokens", "drafted tokens the target accepted", registry=r)
        self.lookup_tokens = Counter("qspec_lookup_tokens", "prompt-lookup tokens the target verified", registry=r)
        self.lookup_accepted_tokens = Counter("qspec_lookup_accepted_tokens",
                                              "prompt-lookup tokens the target accepted", registry=r)
        self.decode_tokens_per_second = Gauge("qspec_decode_tokens_per_second",
                                              "decode speed of the last finished generation", registry=r)
        self.acceptance_rate = Gauge("qspec_acceptance_rate",
                                     "accepted / drafted tokens of the last speculative generation", registry=r)
        self.prefill_seconds = Histogram("qspec_prefill_seconds", "prefill time per generation",
                                         buckets=TIME_BUCKETS, registry=r)
        self.decode_seconds = Histogram("qspec_decode_seconds", "decode time per generation",
                                        buckets=TIME_BUCKETS, registry=r)
        self.queue_seconds = Histogram("qspec_queue_seconds", "time a generation waited for the worker",
                                       buckets=TIME_BUCKETS, registry=r)
        self.first_token_seconds = Histogram("qspec_time_to_first_token_seconds",
                                             "from queueing to the first generated token",
                                             buckets=TIME_BUCKETS, registry=r)

    def generation(self, done: dict) -> None:
        s = done["stats"]
        self.prompt_tokens.inc(done["prompt_tokens"])
        self.cached_prompt_tokens.inc(s.get("cached_prompt_tokens", 0))
        self.generated_tokens.inc(done["completion_tokens"])
        self.prefill_seconds.observe(s.get("prefill_s", 0.0))
        self.decode_seconds.observe(s.get("decode_s", 0.0))
        self.queue_seconds.observe(done["queue_s"])
        self.first_token_seconds.observe(done["first_token_s"])
        if s.get("tokens_per_s"):
            self.decode_tokens_per_second.set(s["tokens_per_s"])
        if s.get("drafted"):
            self.drafted_tokens.inc(s["drafted"])
            self.accepted_tokens.inc(s["accepted"])
            self.acceptance_rate.set(s["acceptance_rate"])
        if s.get("lookup_rows"):
            self.lookup_tokens.inc(s["lookup_rows"])
            self.lookup_accepted_tokens.inc(s["lookup_accepted"])
