"""A host's agent for the serving tests: the real SdkHandlers behind the real socket server, on a SQLite home."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer
from store.db import Store
from store.migrations import upgrade
from store.settings import Settings, get_settings


class Agent:
    def __init__(self, settings: Settings) -> None:
        settings.ensure_home()
        self.settings = settings
        self.store = Store.from_settings(settings)
        upgrade(self.store)
        self.handlers = SdkHandlers(self.store, "serving-host", settings, sync_interval_s=0.1)
        self.server = SocketServer(settings.socket_path, self.handlers).start()

    def stop(self) -> None:
        self.server.stop()
        self.handlers.close()


@pytest.fixture
def agent(fleet_home: Path) -> Iterator[Agent]:
    a = Agent(get_settings(fresh=True))
    yield a
    a.stop()
    a.store.dispose()
