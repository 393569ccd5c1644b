"""Viewer fixtures: the proxy + scripted engine stack of tests/proxy."""

from tests.proxy.conftest import make_stack, stack_store_kind  # noqa: F401  (the fixtures)
