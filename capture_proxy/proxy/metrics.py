"""The proxy's Prometheus metrics (``GET /metrics``, the text exposition format).

Owns the metric names, their labels and buckets, and one ``CollectorRegistry`` per app (no
process-wide registry, so two apps in one process, as in tests, never share a count). It must
not decide what happened to a call: the recorder observes each record as it is persisted
(``observe_call``, ``observe_store_write``, ...) and the call pipeline reports what only it
sees (``inc_in_flight``/``dec_in_flight``, ``observe_upstream`` for the first byte).

Metrics (all prefixed ``capture_proxy_``)::

    calls_total{api, status, prompt_mode}     every record that reached the recorder
    link_verdicts_total{verdict}               root | resolved | refused | unresolved
    link_refusals_total{class}                 refused links by mismatch class
    diagnostics_total{kind}                    call diagnostics by kind
    store_write_seconds                        histogram of put_call (successful or not)
    store_failures_total                       writes that failed (refused and lost calls)
    calls_answered_unstored_total              calls answered although not stored
                                               (store_failure = answer: the loss is marked)
    late_calls_refused_total                   calls to a deleted rollout, not stored (no failure)
    stored_bytes_total                         bytes the store reports written
    upstream_first_byte_seconds                histogram: request sent -> engine's headers
    upstream_seconds                           histogram: request sent -> answer complete
    calls_in_flight                            captured calls started, not yet finished
    requests_in_flight                         HTTP requests whose handler runs (any path)
    read_answers_cut_total                     read API answers cut: the client did not take
                                               their bytes within read_send_timeout_s
    event_loop_lag_seconds                     histogram: how late the event loop ran a timer

With several workers (``serve --workers N``) every worker's metrics live in
prometheus_client's multiprocess files (``multiprocess_dir``, one directory the supervisor
makes and names in ``PROMETHEUS_MULTIPROC_DIR`` before a worker imports prometheus_client) and
``render`` answers the sum over the workers (gauges: over the live ones), so any worker's
``/metrics`` is the whole proxy's.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from capture_proxy.core.records import CallRecord, DiagnosticKind

#: The content type of ``render()``'s bytes.
CONTENT_TYPE = CONTENT_TYPE_LATEST

_STORE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_FIRST_BYTE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOTAL_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
#: Fine from 20 to 75 ms: issue 35's bound on the lag's p99 is 50 ms, and a burst of a thousand
#: streams' tokens (one engine step) takes the loop tens of ms.
_LAG_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.045, 0.05, 0.055, 0.06, 0.075, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class Metrics:
    """The metrics of one proxy app, in their own registry (``registry``); with
    ``multiprocess_dir`` (a worker of several) ``render`` reads every worker's files there."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "capture_proxy_"
        self.calls = Counter(
            p + "calls", "Captured calls by API, status and prompt mode",
            ["api", "status", "prompt_mode"], registry=r,
        )  # fmt: skip
        self.link_verdicts = Counter(
            p + "link_verdicts", "Parent-resolution verdicts of captured calls", ["verdict"],
            registry=r,
        )  # fmt: skip
        self.link_refusals = Counter(
            p + "link_refusals", "Refused links by mismatch class", ["class"], registry=r
        )
        self.diagnostics = Counter(
            p + "diagnostics", "Diagnostics recorded on calls, by kind", ["kind"], registry=r
        )
        self.store_write_seconds = Histogram(
            p + "store_write_seconds", "Time to store one call (seconds)",
            buckets=_STORE_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.store_failures = Counter(
            p + "store_failures",
            "Calls whose storing failed (store_failure = refuse: not answered as a success; "
            "answer: answered, the loss marked on the rollout)",
            registry=r,
        )
        self.answered_unstored = Counter(
            p + "calls_answered_unstored",
            "Calls answered to the harness although their record was not stored "
            "(store_failure = answer)",
            registry=r,
        )
        self.late_calls_refused = Counter(
            p + "late_calls_refused",
            "Calls to a deleted (tombstoned) rollout: answered, not stored; not a store failure",
            registry=r,
        )
        self.uncaptured_generation_calls = Counter(
            p + "uncaptured_generation_calls",
            "Generation calls outside a capture path, by engine path (forwarded or refused; "
            "setting uncaptured_generation)",
            ["path"], registry=r,
        )  # fmt: skip
        self.stored_bytes = Counter(
            p + "stored_bytes", "Bytes written to the store for calls", registry=r
        )
        self.upstream_first_byte_seconds = Histogram(
            p + "upstream_first_byte_seconds",
            "Time from sending a call to the engine to its response headers (seconds)",
            buckets=_FIRST_BYTE_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.upstream_seconds = Histogram(
            p + "upstream_seconds",
            "Time from sending a call to the engine to its complete answer (seconds)",
            buckets=_TOTAL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._add_process_metrics(r, p)
        #: labelled children by (metric, label values): see ``_child``
        self._children: dict[tuple[Counter, tuple[str, ...]], Counter] = {}

    def _add_process_metrics(self, r: CollectorRegistry, p: str) -> None:
        """The metrics of the process's own state: what is in flight, the reads cut, the link
        indexes made, the event loop's lag."""
        self.calls_in_flight = Gauge(
            p + "calls_in_flight", "Captured calls started and not yet finished", registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.requests_in_flight = Gauge(
            p + "requests_in_flight", "HTTP requests whose handler runs (any path)",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.read_answers_cut = Counter(
            p + "read_answers_cut", "Read API answers cut after they started: the client did "
            "not take their bytes within read_send_timeout_s", registry=r,
        )  # fmt: skip
        self.link_index_loads = Counter(
            p + "link_index_loads", "Rollouts' link indexes made from the store: a rollout's "
            "first call in this process, or its next one after the index was evicted "
            "(link_index_max_rollouts, link_index_max_calls: many more loads than rollouts "
            "mean the rollouts in flight do not fit)", registry=r,
        )  # fmt: skip
        self.event_loop_lag_seconds = Histogram(
            p + "event_loop_lag_seconds",
            "How late the event loop ran a timer due every 50 ms (seconds): the wait every "
            "request on the loop had",
            buckets=_LAG_BUCKETS_S, registry=r,
        )  # fmt: skip

    # --- what the call pipeline reports ---------------------------------------------------

    def inc_in_flight(self) -> None:
        self.calls_in_flight.inc()

    def dec_in_flight(self) -> None:
        self.calls_in_flight.dec()

    def observe_upstream(self, first_byte_s: float | None, total_s: float | None = None) -> None:
        """One engine call: seconds to its response headers and to its complete answer (either
        may be None: not known). The recorder reports ``total_s`` of every record from its
        ``latency_ms``; a pipeline hook reports ``first_byte_s`` only, so none is counted
        twice."""
        if first_byte_s is not None and first_byte_s >= 0:
            self.upstream_first_byte_seconds.observe(first_byte_s)
        if total_s is not None and total_s >= 0:
            self.upstream_seconds.observe(total_s)

    # --- what the recorder reports --------------------------------------------------------

    def observe_call(self, record: CallRecord, prompt_mode: str) -> None:
        """A record reaching the recorder: its API, status, prompt mode, verdict, diagnostics
        and upstream latency."""
        api = getattr(record, "api", None) or "chat_completions"
        self._child(self.calls, str(api), record.status.value, prompt_mode).inc()
        linking: dict[str, Any] = record.linking or {}
        verdict = linking.get("verdict")
        if verdict is not None:
            self._child(self.link_verdicts, str(verdict)).inc()
            if verdict in ("refused", "prefix") and _has_refusal(record):
                self.link_refusals.labels(_refusal_class(record)).inc()
        for d in record.diagnostics:
            self.diagnostics.labels(d.kind).inc()
        if record.latency_ms is not None:
            self.observe_upstream(None, record.latency_ms / 1000)

    def _child(self, metric: Counter, *labels: str) -> Counter:
        """``metric.labels(*labels)``, kept (``labels`` takes a lock and checks the values on
        every call; these are asked on every call)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_store_write(self, seconds: float, stored_bytes: int | None) -> None:
        self.store_write_seconds.observe(seconds)
        if stored_bytes:
            self.stored_bytes.inc(stored_bytes)

    def inc_store_failures(self) -> None:
        self.store_failures.inc()

    def inc_answered_unstored(self) -> None:
        self.answered_unstored.inc()

    def inc_uncaptured_generation(self, path: str) -> None:
        """``path``: a bounded label (``core.fronts.generation_path``), never a raw path."""
        self._child(self.uncaptured_generation_calls, path).inc()

    def inc_late_calls_refused(self) -> None:
        self.late_calls_refused.inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text format (``CONTENT_TYPE``); with
        ``multiprocess_dir``, every worker's metrics summed (then this registry's collectors
        that read live state at scrape time are not in it: see ``serve --workers``)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
        return generate_latest(registry)


def _has_refusal(record: CallRecord) -> bool:
    """A refused digest link (a ``prefix`` link may follow one, or an unmatched history)."""
    return record.linking is not None and (
        record.linking.get("verdict") == "refused"
        or any(d.kind == "parent_digest_mismatch" for d in record.diagnostics)
    )


def _refusal_class(record: CallRecord) -> str:
    """The mismatch class of a refused link (``retokenized``, ``template_rerendered``,
    ``system_changed``, ``history_edited``), or the refusal's reason (``parent incomplete``)."""
    candidate = (record.linking or {}).get("digest_parent_call_id")
    for d in record.diagnostics:
        if (
            d.kind == DiagnosticKind.PARENT_DIGEST_MISMATCH
            and d.details.get("parent_call_id", candidate) == candidate
        ):
            return str(d.details.get("class") or d.details.get("reason") or "unknown")
    return "unknown"


#: The app's ``Metrics`` (also ``Recorder.metrics``).
METRICS_KEY = web.AppKey("metrics", Metrics)
