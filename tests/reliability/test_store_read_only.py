"""A PostgreSQL store that turns read-only under load, then writable again (issue 34).

What a failover to a standby, or an operator's ``default_transaction_read_only``, does to the
proxy: after a number of answered calls the database is set read-only
(``ALTER DATABASE ... SET default_transaction_read_only = on``, which new sessions take, and
the store's sessions ended with ``pg_terminate_backend`` so its pool reconnects: "cannot
execute INSERT in a read-only transaction"); once every session is refused or done, it is set
writable again the same way. The load and the checks are ``store_load``'s, as for the full
disk: with ``store_failure = refuse`` every answered call is stored exactly once after
recovery and ``/health`` recovers by itself; with ``answer`` every lost call is marked on its
rollout once the database takes writes again.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.scripted_engine.app import ScriptedEngineConfig, build_scripted_engine_app
from capture_proxy.store.postgres import PostgresStore
from tests.reliability.store_load import (
    Load,
    check_marked_losses,
    check_refused_run,
    health,
    lost_calls,
    metric,
    metrics_text,
)

pytestmark = pytest.mark.postgres

SESSIONS = 24
STEPS = 3
READ_ONLY_AFTER = 20  # answered calls
DEADLINE_S = 120.0


def _set_read_only(server, database: str, read_only: bool) -> None:
    """Set the database's default and end its sessions (the store's pool reconnects)."""
    import psycopg

    value = "on" if read_only else "off"
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = {value}')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        )


async def _proxy(aiohttp_server, aiohttp_client, qwen_tokenizer, postgres_server, tmp_path, mode):
    engine = await aiohttp_server(build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer))
    url = postgres_server.create_database()
    settings = Settings(
        backend=str(engine.make_url("/")).rstrip("/"), store=tmp_path / "unused", store_failure=mode
    )
    client = await aiohttp_client(build_proxy_app(settings, PostgresStore(url, pool_size=4)))
    return client, urlsplit(url).path.lstrip("/")


async def _load_until_read_only(client, server, database: str) -> Load:
    load = Load(client, SESSIONS, STEPS, DEADLINE_S, milestone_answers=READ_ONLY_AFTER)
    load.start("ro")
    await asyncio.wait_for(load.milestone.wait(), DEADLINE_S)
    await asyncio.to_thread(_set_read_only, server, database, True)
    return load


async def test_a_read_only_database_refuses_calls_and_recovers(
    aiohttp_server, aiohttp_client, qwen_tokenizer, postgres_server, tmp_path
):
    client, database = await _proxy(
        aiohttp_server, aiohttp_client, qwen_tokenizer, postgres_server, tmp_path, "refuse"
    )
    load = await _load_until_read_only(client, postgres_server, database)
    await asyncio.wait_for(load.stalled.wait(), DEADLINE_S)
    assert load.refused and load.waiting > 0
    status, body = await health(client)
    assert (status, body["status"]) == (503, "degraded")
    assert body["store"]["write_error"]
    text = await metrics_text(client)
    assert metric(text, "capture_proxy_store_failures_total") == len(load.refused)

    await asyncio.to_thread(_set_read_only, postgres_server, database, False)
    load.recovered.set()
    await asyncio.wait_for(asyncio.gather(*load.tasks), DEADLINE_S)
    status, body = await health(client)
    assert (status, body["status"]) == (200, "ok"), body
    figures = await check_refused_run(client, load)
    assert figures["answered"] == SESSIONS * STEPS
    print(f"\nread-only PostgreSQL, store_failure = refuse: {figures}")


async def test_a_read_only_database_with_answer_setting_marks_every_lost_call(
    aiohttp_server, aiohttp_client, qwen_tokenizer, postgres_server, tmp_path
):
    client, database = await _proxy(
        aiohttp_server, aiohttp_client, qwen_tokenizer, postgres_server, tmp_path, "answer"
    )
    load = await _load_until_read_only(client, postgres_server, database)
    await asyncio.wait_for(asyncio.gather(*load.tasks), DEADLINE_S)
    assert not load.refused
    lost = await lost_calls(client, load)
    num_lost = sum(len(v) for v in lost.values())
    assert num_lost > 0
    status, body = await health(client)
    assert (status, body["status"]) == (503, "degraded")
    assert body["store"]["unmarked_losses"]["calls"] == num_lost  # read-only: no mark fits
    await check_marked_losses(client, lost)  # from memory meanwhile

    await asyncio.to_thread(_set_read_only, postgres_server, database, False)
    after = Load(client, 1, 1, DEADLINE_S)
    await asyncio.wait_for(asyncio.gather(*after.start("after")), DEADLINE_S)
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while (await health(client))[0] != 200:  # the marks run off the call's path
        assert loop.time() < end
        await asyncio.sleep(0.05)
    await check_marked_losses(client, lost)  # now from the store
    text = await metrics_text(client)
    assert metric(text, "capture_proxy_calls_answered_unstored_total") == num_lost
    print(
        f"\nread-only PostgreSQL, store_failure = answer: sent {len(load.attempts)}, answered "
        f"{len(load.answered)}, stored {len(load.answered) - num_lost}, lost and marked "
        f"{num_lost}, store_failures {int(metric(text, 'capture_proxy_store_failures_total'))}"
    )
