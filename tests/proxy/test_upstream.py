"""The upstream session: the aiohttp defaults that bite a proxy are set explicitly."""

from capture_proxy.config import Settings
from capture_proxy.proxy.upstream import HOP_BY_HOP, forwardable_headers, make_client_session


async def test_pool_and_timeouts_sized_for_thousands_of_rollouts():
    settings = Settings.model_validate({"backend": "http://127.0.0.1:9"})
    session = make_client_session(settings)
    try:
        connector = session.connector
        assert connector is not None
        assert connector.limit == 4096 and connector.limit_per_host == 0
        # Idle upstream connections close before the engine's own keep-alive (uvicorn: 5 s),
        # so the proxy never reuses a connection the engine is closing (the 5 s race).
        assert connector._keepalive_timeout == 2.0 < 5.0
        timeout = session.timeout
        assert timeout.total is None  # no 5-minute cut of long generations
        assert timeout.sock_connect == 10.0 and timeout.sock_read is None
        assert session.auto_decompress is False  # pass-through bytes stay as the engine sent
    finally:
        await session.close()


def test_hop_by_hop_headers_are_not_forwarded():
    headers = forwardable_headers(
        [
            ("Connection", "keep-alive, X-Private"),
            ("X-Private", "1"),
            ("Host", "h"),
            ("Content-Length", "3"),
            ("Authorization", "Bearer k"),
            ("X-Session-Id", "s"),
        ]
    )
    assert dict(headers) == {"Authorization": "Bearer k", "X-Session-Id": "s"}
    assert {"connection", "transfer-encoding", "upgrade"} <= HOP_BY_HOP


class _FlakySession:
    """Fails to connect ``failures`` times, then answers (stands in for ClientSession)."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def request(self, method, url, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "response"


def _connect_error():
    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey

    key = ConnectionKey("127.0.0.1", 9, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))


async def test_connections_that_could_not_be_made_are_retried():
    import aiohttp

    from capture_proxy.proxy.upstream import send_upstream

    session = _FlakySession(2, _connect_error())
    got = await send_upstream(
        session, "POST", "http://x", first_byte_timeout_s=5, connect_retries=2
    )
    assert (got, session.calls) == ("response", 3)
    session = _FlakySession(3, _connect_error())
    try:
        await send_upstream(
            session, "POST", "http://x", first_byte_timeout_s=None, connect_retries=2
        )
        raise AssertionError("expected the connect error")
    except aiohttp.ClientConnectorError:
        assert session.calls == 3
    # A failure after the request was sent is never retried (the engine may have run it).
    session = _FlakySession(1, aiohttp.ServerDisconnectedError())
    try:
        await send_upstream(
            session, "POST", "http://x", first_byte_timeout_s=None, connect_retries=2
        )
        raise AssertionError("expected the disconnect")
    except aiohttp.ServerDisconnectedError:
        assert session.calls == 1
