"""Failover through a real load balancer (issue 14 item 5, the small version): two
``capture-proxy serve`` replicas on one PostgreSQL store behind HAProxy (``configs/haproxy.cfg``,
Debian's package), SIGKILL one under streaming load.

Every call whose answer completed is readable with the ids and log probs the engine sent, every
rollout is one complete chain of the calls its harness completed (a cut call is sent again with
the SDK retry header and goes to the live replica), no false link, and rollouts of the killed
replica continued on the other. Loopback only, every wait bounded (``benchmarks/replicas.py``).
"""

from __future__ import annotations

import pytest

from benchmarks.infra import haproxy_binary
from benchmarks.replicas import failover, pg_deployment
from benchmarks.services import engine_service
from benchmarks.sessions import client_session

pytestmark = pytest.mark.postgres

ROLLOUTS = 24
STEPS = 3
KILL_AFTER = 30  # completed calls: past every session's first step, before most second steps
DEADLINE_S = 180.0


async def test_sigkill_of_a_replica_behind_haproxy_loses_nothing(postgres_server, tmp_path):
    haproxy = haproxy_binary()
    if haproxy is None:
        pytest.fail("HAProxy is not installed (scripts/install-haproxy)")
    engine = engine_service(tmp_path)
    engine.start()
    deployment = pg_deployment(
        tmp_path, engine.url, postgres_server.create_database(), 2, haproxy, "failover"
    )
    try:
        async with client_session(ROLLOUTS + 8, read_timeout_s=DEADLINE_S) as session:
            await engine.wait_healthy(session, 60)
            await deployment.start(session, deadline_s=60)
            report = await failover(session, deployment, ROLLOUTS, STEPS, KILL_AFTER, DEADLINE_S)
        assert report.problems == []
        assert report.killed_after == KILL_AFTER
        assert report.cut > 0, "the kill cut no call: it was not under load"
        assert report.completed == report.calls_checked == ROLLOUTS * STEPS
        assert report.rollouts_checked == ROLLOUTS
        assert report.moved_rollouts > 0
        assert report.ok
    finally:
        deployment.stop()
        engine.stop()
