"""The aiohttp adapter: routes, forwards, captures, persists. Thin over ``capture_proxy.core``."""
