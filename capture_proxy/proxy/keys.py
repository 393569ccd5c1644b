"""The typed keys of the app's state (aiohttp ``AppKey``s), shared by every adapter.

The composition root (``capture_proxy.app``) sets them once when it builds the app; the
dispatch (``proxy.app``), the read API (``rest*``) and the viewer read them. Living here, below
all of those, lets each read the state without importing the others. Must not: hold values
(a key is a name and a type, never a setting or a default).
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from capture_proxy.config import Settings
from capture_proxy.proxy.engine_probe import EngineProbe
from capture_proxy.proxy.exact import ExactTokens
from capture_proxy.proxy.linker import Linker
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.store.base import CaptureStore
from harness_notes import NoteRegistry

SETTINGS_KEY = web.AppKey("settings", Settings)
STORE_KEY = web.AppKey("store", CaptureStore)
RECORDER_KEY = web.AppKey("recorder", Recorder)
LINKER_KEY = web.AppKey("linker", Linker)
#: the one upstream ``ClientSession`` (opened and closed with the app)
SESSION_KEY = web.AppKey("upstream_session", aiohttp.ClientSession)
NOTES_KEY = web.AppKey("harness_notes", NoteRegistry)
#: set only when some model is served in exact-token mode
EXACT_KEY = web.AppKey("exact_tokens", ExactTokens)
ENGINE_PROBE_KEY = web.AppKey("engine_probe", EngineProbe)


@dataclass(frozen=True)
class WorkerRole:
    """This app is worker ``index`` (from 0) of ``count`` serving one port (``serve
    --workers``); their metrics live together in ``metrics_dir`` (prometheus_client's
    multiprocess files), the engines' pins in ``pins_path`` (``proxy.engines.map_pin_board``;
    None: this worker's own)."""

    index: int
    count: int
    metrics_dir: str
    pins_path: str | None = None


#: set only in a worker of several
WORKER_KEY = web.AppKey("worker_role", WorkerRole)
