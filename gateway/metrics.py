"""Prometheus metrics of one replica, on a registry of its own (no globals).

Gauges count the live sessions this replica moved into each state; summed
over replicas they give the cluster's view, because each transition is
performed by exactly one replica (the one whose Lua script made it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.domain.states import SessionState

if TYPE_CHECKING:
    from gateway.admission import Admission

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LIVE_STATES = (SessionState.OPEN, SessionState.STREAMING, SessionState.GENERATING)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions = Gauge("omni_gateway_sessions", "Live sessions by state", ["state"], registry=r)
        self.transitions = Counter("omni_gateway_session_transitions", "Sessions entering a state",
                                   ["state"], registry=r)
        self.chunks = Counter("omni_gateway_chunks", "Chunks received", ["modality", "outcome"], registry=r)
        self.chunk_bytes = Counter("omni_gateway_chunk_bytes", "Payload bytes accepted", ["modality"],
                                   registry=r)
        self.append_latency = Histogram("omni_gateway_append_latency_seconds",
                                        "Time to acknowledge a chunk", buckets=LATENCY_BUCKETS, registry=r)
        self.engine_start = Histogram("omni_gateway_engine_start_seconds",
                                      "Session creation to engine session open", buckets=SECONDS_BUCKETS,
                                      registry=r)
        self.ttft = Histogram("omni_gateway_ttft_after_input_seconds",
                              "End of input to the first output token", buckets=SECONDS_BUCKETS, registry=r)
        self.errors = Counter("omni_gateway_errors", "Errors returned to clients", ["code"], registry=r)
        self.engine_errors = Counter("omni_gateway_engine_errors", "Engine sessions that failed", ["code"],
                                     registry=r)
        self.tender_failures = Counter("omni_gateway_tender_failures", "Tender rounds that failed (it retries)",
                                       ["code"], registry=r)
        # Scheduling (many sessions, one engine).
        self.parks = Counter("omni_gateway_sessions_parked", "Idle streaming sessions whose engine request was "
                             "aborted to free its KV cache", ["reason"], registry=r)
        self.replaced_chunks = Counter("omni_gateway_chunks_replaced", "Chunks replaced (update mode)", registry=r)
        self.engine_sessions = Gauge("omni_gateway_engine_sessions", "Engine sessions this replica runs, by "
                                     "whether their input is still arriving", ["phase"], registry=r)
        self.answers_waiting = Gauge("omni_gateway_answers_waiting", "Input-complete sessions the last tender "
                                     "round found waiting for room", registry=r)

        self.connections = Gauge("omni_gateway_realtime_connections_open", "Open Realtime WebSocket connections",
                                 registry=r)
        self.connections_total = Counter("omni_gateway_realtime_connections", "Realtime connections accepted (_total)",
                                         registry=r)
        self.connection_seconds = Histogram("omni_gateway_realtime_connection_seconds",
                                            "How long Realtime connections stay open", registry=r,
                                            buckets=(1, 5, 15, 60, 300, 900, 3600))
        self.realtime_events = Counter("omni_gateway_realtime_events", "Realtime events by direction and type",
                                       ["direction", "type"], registry=r)

    def watch_admission(self, admission: Admission) -> None:
        """Expose the load that sheds calls (read at scrape time, nothing per request)."""
        Gauge("omni_gateway_requests_in_flight", "Session API calls this process is working on",
              registry=self.registry).set_function(lambda: admission.in_flight)
        Gauge("omni_gateway_event_loop_lag_seconds", "How late this process's event loop runs a timer",
              registry=self.registry).set_function(lambda: admission.loop_lag_sec)

    def transition(self, before: SessionState | None, after: SessionState) -> None:
        if before == after:
            return
        if before in LIVE_STATES:
            self.sessions.labels(before.value).dec()
        if after in LIVE_STATES:
            self.sessions.labels(after.value).inc()
        self.transitions.labels(after.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
