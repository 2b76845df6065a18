"""The agent's /metrics app keeps prometheus_client's formatted answer while what it shows stays the same."""

from __future__ import annotations

from wsgiref.util import setup_testing_defaults

from prometheus_client import CollectorRegistry, Gauge

from collector.metrics import CachedExposition


def _get(app: CachedExposition, accept: str = "", encoding: str = "") -> tuple[str, dict[str, str], bytes]:
    environ: dict = {"PATH_INFO": "/metrics", "HTTP_ACCEPT": accept, "HTTP_ACCEPT_ENCODING": encoding}
    setup_testing_defaults(environ)
    got: dict = {}

    def start_response(status: str, headers: list[tuple[str, str]], *_: object) -> None:
        got["status"], got["headers"] = status, dict(headers)

    body = b"".join(app(environ, start_response))
    return got["status"], got["headers"], body


def test_one_render_per_state_and_request_shape() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("fleetlens_test_value", "A value.", registry=registry)
    state = [0]
    app = CachedExposition(registry, lambda: state[0])
    gauge.set(1)
    status, headers, first = _get(app)
    assert status.startswith("200") and b"fleetlens_test_value 1.0" in first
    gauge.set(2)  # the state did not move: the kept answer is served
    assert _get(app)[2] == first and app.renders == 1
    state[0] = 1  # it moved: formatted again
    assert b"fleetlens_test_value 2.0" in _get(app)[2] and app.renders == 2
    # Prometheus asks for OpenMetrics, compressed: its own answer, kept apart from the plain text one
    status, headers, body = _get(app, accept="application/openmetrics-text; version=1.0.0", encoding="gzip")
    assert headers["Content-Encoding"] == "gzip" and headers["Content-Type"].startswith("application/openmetrics")
    assert _get(app, accept="application/openmetrics-text; version=1.0.0", encoding="gzip")[2] == body
    assert _get(app)[2] != body and app.renders == 3
