"""Tier 2: ``/metrics`` (Prometheus text, one registry per app) and what ``/health`` tells
about the engine (a cached, bounded probe) and hides when a token is set."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.core.records import Diagnostic, DiagnosticKind
from capture_proxy.proxy.keys import ENGINE_PROBE_KEY
from capture_proxy.proxy.metrics import Metrics
from capture_proxy.proxy.recorder import Recorder, StoreWrite
from capture_proxy.scripted_engine.faults import Faults
from capture_proxy.scripted_engine.state import ScriptedEngineConfig
from capture_proxy.store.sqlite import SQLiteStore
from tests.factories import record
from tests.proxy.conftest import MakeStack, Stack
from tests.proxy.test_capture import USER, _body, _read_stream
from tests.proxy.test_failures import _free_port


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


async def _metrics(stack: Stack, **kwargs: Any) -> str:
    resp = await stack.client.get("/metrics", **kwargs)
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "text/plain"
    return await resp.text()


async def test_a_captured_call_shows_in_the_metrics(stack: Stack):
    before = await _metrics(stack)
    assert value(before, "capture_proxy_calls_in_flight") == 0
    resp = await stack.chat("m1", _body(USER, stream=True))
    _, done = await _read_stream(resp)
    assert done
    text = await _metrics(stack)
    labels = {"api": "chat_completions", "status": "complete", "prompt_mode": "backend_template"}
    assert value(text, "capture_proxy_calls_total", **labels) == 1
    assert value(text, "capture_proxy_link_verdicts_total", verdict="root") == 1
    assert value(text, "capture_proxy_store_write_seconds_count") == 1
    assert value(text, "capture_proxy_upstream_seconds_count") == 1
    assert value(text, "capture_proxy_stored_bytes_total") > 0
    assert value(text, "capture_proxy_store_failures_total") == 0
    # Proxied, not captured: no call is counted.
    await stack.client.get("/v1/models")
    assert value(await _metrics(stack), "capture_proxy_calls_total", **labels) == 1


async def test_each_app_has_its_own_registry(make_stack: MakeStack, tmp_path):
    one, two = await make_stack(), await make_stack(store_dir=tmp_path / "other")
    await one.chat("m1", _body(USER))
    labels = {"api": "chat_completions", "status": "complete", "prompt_mode": "backend_template"}
    assert value(await _metrics(one), "capture_proxy_calls_total", **labels) == 1
    assert value(await _metrics(two), "capture_proxy_calls_total", **labels) == 0


async def test_metrics_are_behind_the_read_api_token(make_stack: MakeStack):
    stack = await make_stack(captures_token="s3cret")
    resp = await stack.client.get("/metrics")
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"
    await _metrics(stack, headers={"Authorization": "Bearer s3cret"})


async def test_late_calls_are_counted_apart_from_store_failures(stack: Stack):
    await stack.chat("gone", _body(USER))
    assert (await stack.client.delete("/captures/rollouts/gone")).status == 200
    assert (await stack.chat("gone", _body(USER))).status == 200
    text = await _metrics(stack)
    assert value(text, "capture_proxy_late_calls_refused_total") == 1
    assert value(text, "capture_proxy_store_failures_total") == 0


async def test_the_recorder_counts_verdicts_refusal_classes_diagnostics_and_failures(tmp_path):
    class FailingStore(SQLiteStore):
        async def put_call(self, record, request=None, digests=None):  # type: ignore[override]
            raise OSError("disk gone")

    metrics = Metrics()
    store = FailingStore(tmp_path / "s")
    await store.open()
    try:
        recorder = Recorder(store, metrics=metrics, prompt_mode_for=lambda model: "exact_tokens")
        refused = record("c1", [1, 2], [3]).replace(
            model="m",
            latency_ms=1500.0,
            linking={"verdict": "refused", "digest_parent_call_id": "c0"},
            diagnostics=[
                Diagnostic(
                    DiagnosticKind.PARENT_DIGEST_MISMATCH,
                    {"parent_call_id": "c0", "class": "retokenized"},
                ),
                Diagnostic(DiagnosticKind.HARNESS_NOTE_REWRITTEN, {}),
            ],
        )
        refused.api = "responses"  # type: ignore[attr-defined]  # the pipeline's coming field
        assert await recorder.persist(refused) is StoreWrite.REFUSED
    finally:
        await store.close()
    text = metrics.render().decode()
    labels = {"api": "responses", "status": "complete", "prompt_mode": "exact_tokens"}
    assert value(text, "capture_proxy_calls_total", **labels) == 1
    assert value(text, "capture_proxy_link_verdicts_total", verdict="refused") == 1
    assert value(text, "capture_proxy_link_refusals_total", **{"class": "retokenized"}) == 1
    kind = DiagnosticKind.HARNESS_NOTE_REWRITTEN.value
    assert value(text, "capture_proxy_diagnostics_total", kind=kind) == 1
    assert value(text, "capture_proxy_store_failures_total") == 1
    assert value(text, "capture_proxy_upstream_seconds_sum") == 1.5
    assert value(text, "capture_proxy_store_write_seconds_count") == 1


def test_pipeline_hooks_first_byte_and_in_flight():
    metrics = Metrics()
    metrics.inc_in_flight()
    metrics.inc_in_flight()
    metrics.dec_in_flight()
    metrics.observe_upstream(0.25)
    metrics.observe_upstream(0.5, 2.0)
    text = metrics.render().decode()
    assert value(text, "capture_proxy_calls_in_flight") == 1
    assert value(text, "capture_proxy_upstream_first_byte_seconds_count") == 2
    assert value(text, "capture_proxy_upstream_first_byte_seconds_sum") == 0.75
    assert value(text, "capture_proxy_upstream_first_byte_seconds_bucket", le="0.25") == 1
    assert value(text, "capture_proxy_upstream_seconds_count") == 1


async def test_health_says_whether_the_engine_answers_probing_at_most_once_per_interval(
    make_stack: MakeStack,
):
    stack = await make_stack(engine_health_interval_s=3600.0)
    first, second = await asyncio.gather(stack.get_json("/health"), stack.get_json("/health"))
    assert first["engine"]["ok"] is True and first["engine"]["status"] == 200
    assert second["engine"] == first["engine"]
    await stack.get_json("/health")
    assert stack.client.app[ENGINE_PROBE_KEY].probes == 1


async def test_health_reports_an_engine_that_is_down_as_engine_unreachable(
    aiohttp_client, tmp_path, caplog
):
    port = _free_port()
    settings = Settings(
        backend=f"http://user:s3cret@127.0.0.1:{port}",
        store=tmp_path / "s",
        engine_health_interval_s=3600.0,
    )
    caplog.set_level(logging.WARNING, logger="capture_proxy")
    client = await aiohttp_client(build_proxy_app(settings, SQLiteStore(tmp_path / "s")))
    # Start-up probed the engine once and warned, naming it without its password.
    warnings = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"the engine at http://user:***@127.0.0.1:{port} does not")
    assert "s3cret" not in caplog.text
    resp = await client.get("/health")
    assert resp.status == 503  # no call can be served: not "ok"
    health = await resp.json()
    assert health["status"] == "engine_unreachable"
    assert health["engine"]["ok"] is False and health["engine"]["status"] is None
    assert health["engine"]["error"]
    assert client.app[ENGINE_PROBE_KEY].probes == 1  # /health used the start-up probe


@pytest.mark.parametrize(
    ("store_ok", "engine", "expected"),
    [
        (True, {"ok": True}, ("ok", 200)),
        (True, None, ("ok", 200)),  # the read-only app: no engine
        (True, {"ok": False}, ("engine_unreachable", 503)),
        (False, {"ok": True}, ("degraded", 503)),
        (False, {"ok": False}, ("degraded", 503)),  # the store's failure first
    ],
)
def test_health_status_takes_the_worst_condition(store_ok, engine, expected):
    from capture_proxy.proxy.status import health_status

    assert health_status(store_ok=store_ok, engine=engine) == expected


async def test_health_waits_on_a_silent_engine_only_up_to_its_timeout(
    aiohttp_server, aiohttp_client, tmp_path
):
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    engine_app = web.Application()
    engine_app.router.add_get("/health", silent)
    engine = await aiohttp_server(engine_app)
    settings = Settings(
        backend=str(engine.make_url("/")).rstrip("/"),
        store=tmp_path / "s",
        engine_health_timeout_s=0.2,
    )
    client = await aiohttp_client(build_proxy_app(settings, SQLiteStore(tmp_path / "s")))
    health = await (await client.get("/health")).json()
    assert health["engine"] == {**health["engine"], "ok": False, "status": None}
    assert "no answer within 0.2 s" in health["engine"]["error"]


@pytest.mark.parametrize(("token", "shows_path"), [(None, True), ("captures_token", False)])
async def test_health_hides_the_store_path_when_a_token_is_set(
    make_stack: MakeStack, token, shows_path
):
    stack = await make_stack(**({token: "s3cret"} if token else {}))
    store = (await stack.get_json("/health"))["store"]
    assert ("path" in store) is shows_path
    assert store["calls"] == 0


async def test_event_loop_lag_and_requests_in_flight_are_metrics(make_stack: MakeStack):
    """The lag sampler observes about 20 times a second; the in-flight gauge counts the
    scrape itself (its handler runs while it renders), a stream while it runs, nothing after."""
    faults = Faults(first_byte_delay_s=1.0)
    stack = await make_stack(engine_config=ScriptedEngineConfig(faults=faults))
    first = await _metrics(stack)
    await asyncio.sleep(0.5)
    text = await _metrics(stack)
    count = value(text, "capture_proxy_event_loop_lag_seconds_count")
    assert count - value(first, "capture_proxy_event_loop_lag_seconds_count") >= 5
    assert value(text, "capture_proxy_requests_in_flight") == 1
    call = asyncio.create_task(stack.chat("m1", _body(USER, stream=True)))
    seen = []
    async with asyncio.timeout(0.9):  # the call waits 1 s for the engine's first byte
        while not seen or seen[-1] != 2:
            seen.append(value(await _metrics(stack), "capture_proxy_requests_in_flight"))
    assert not call.done() and set(seen) <= {1, 2}
    resp = await call
    await _read_stream(resp)
    assert value(await _metrics(stack), "capture_proxy_requests_in_flight") == 1
