"""Prometheus metrics of one replica, on a registry of its own (no globals).

Gauges count the live sessions this replica moved into each state; summed
over replicas they give the cluster's view, because each transition is
performed by exactly one replica (the one whose Lua script made it).

A replica with API workers is several processes (``gateway/runtime/processes.py``),
and a scrape of its port reaches any one of them. There the processes keep
their values in prometheus_client's multiprocess files (``SHARED_DIR_ENV``,
set by ``serve`` before any metric exists) and every process renders the
replica's sum: counters and histograms add up, a gauge moved by several
processes adds up (``sum``), a gauge of live things counts live processes
only (``livesum``). The loop's own gauges (calls in flight, loop lag) are the
answering process's, as they are about that process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.domain.states import SessionState

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LIVE_STATES = (SessionState.OPEN, SessionState.STREAMING, SessionState.GENERATING)
#: prometheus_client's own switch: where a replica's processes keep their values.
SHARED_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class ProcessLoad(Protocol):
    """What sheds calls in this process (``web/middleware/admission.py``'s ``Admission``)."""

    @property
    def in_flight(self) -> int: ...

    @property
    def loop_lag_sec(self) -> float: ...


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        #: Gauges read from this process at scrape time (never shared between processes).
        self._own = CollectorRegistry()
        self._shared_dir = os.environ.get(SHARED_DIR_ENV)
        r = self.registry
        # A worker moves a session into a state and the engine process moves it on: the sum is the count.
        self.sessions = Gauge("omni_gateway_sessions", "Live sessions by state", ["state"], registry=r,
                              multiprocess_mode="sum")
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
        self.slots_healed = Counter("omni_gateway_cap_slots_healed", "Cap slots the tender freed because no "
                                    "release had (it failed, or never ran)", registry=r)
        self.sessions_quarantined = Counter(
            "omni_gateway_sessions_quarantined", "Due sessions whose own script failed in a tender round: "
            "backed off (retry) or out of the schedule for good (dead)", ["outcome"], registry=r)
        # Scheduling (many sessions, one engine).
        self.parks = Counter("omni_gateway_sessions_parked", "Idle streaming sessions whose engine request was "
                             "aborted to free its KV cache", ["reason"], registry=r)
        self.replaced_chunks = Counter("omni_gateway_chunks_replaced", "Chunks replaced (update mode)", registry=r)
        self.engine_sessions = Gauge("omni_gateway_engine_sessions", "Engine sessions this replica runs, by "
                                     "whether their input is still arriving", ["phase"], registry=r,
                                     multiprocess_mode="livesum")
        self.answers_waiting = Gauge("omni_gateway_answers_waiting", "Input-complete sessions the last tender "
                                     "round found waiting for room", registry=r, multiprocess_mode="livesum")

        self.connections = Gauge("omni_gateway_realtime_connections_open", "Open Realtime WebSocket connections",
                                 registry=r, multiprocess_mode="livesum")
        self.connections_total = Counter("omni_gateway_realtime_connections", "Realtime connections accepted (_total)",
                                         registry=r)
        self.connection_seconds = Histogram("omni_gateway_realtime_connection_seconds",
                                            "How long Realtime connections stay open", registry=r,
                                            buckets=(1, 5, 15, 60, 300, 900, 3600))
        self.realtime_events = Counter("omni_gateway_realtime_events", "Realtime events by direction and type",
                                       ["direction", "type"], registry=r)
        self._realtime_counted: dict[tuple[str, str], Counter] = {}

    def watch_admission(self, admission: ProcessLoad) -> None:
        """Expose the load that sheds calls (read at scrape time, nothing per request)."""
        self._own.register(_ProcessLoad(admission))

    def realtime_event(self, direction: str, kind: str) -> None:
        """Count one Realtime event. The labelled counters are kept, as ``labels()`` costs four
        times the increment and every answer token is an event (the kinds are the protocol's few)."""
        counter = self._realtime_counted.get((direction, kind))
        if counter is None:
            counter = self._realtime_counted[direction, kind] = self.realtime_events.labels(direction, kind)
        counter.inc()

    def transition(self, before: SessionState | None, after: SessionState) -> None:
        if before == after:
            return
        if before in LIVE_STATES:
            self.sessions.labels(before.value).dec()
        if after in LIVE_STATES:
            self.sessions.labels(after.value).inc()
        self.transitions.labels(after.value).inc()

    def render(self) -> bytes:
        """The replica's metrics (all its processes'), then this process's own gauges."""
        if self._shared_dir:
            replica = CollectorRegistry()
            MultiProcessCollector(replica, path=self._shared_dir)  # type: ignore[no-untyped-call]
            return generate_latest(replica) + generate_latest(self._own)
        return generate_latest(self.registry) + generate_latest(self._own)


class _ProcessLoad(Collector):
    """This process's load, read when scraped. A collector, not Gauge objects: in
    multiprocess mode a Gauge keeps a file of its own, and the replica's sum would
    describe these metrics a second time (per pid, always 0)."""

    def __init__(self, admission: ProcessLoad) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("omni_gateway_requests_in_flight", "Session API calls this process is working on",
                                value=self._admission.in_flight)
        yield GaugeMetricFamily("omni_gateway_event_loop_lag_seconds",
                                "How late this process's event loop runs a timer", value=self._admission.loop_lag_sec)
