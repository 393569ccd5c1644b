"""Viewer fixtures: the proxy + scripted engine stack of tests/proxy."""

from tests.proxy.conftest import make_stack  # noqa: F401  (the fixture)
