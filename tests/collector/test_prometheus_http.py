"""The importer's Prometheus client against servers that are not quite Prometheus: each answer it cannot use is
either worked around (label values) or told plainly (queries)."""

from __future__ import annotations

import httpx
import pytest

from collector.importers.prometheus_http import PrometheusClient
from store.errors import InvalidInput

NAMES = ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"]


def client_of(handler) -> PrometheusClient:
    client = PrometheusClient("http://prometheus.test:9090")
    client._http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(handler))
    return client


def test_a_proxy_without_label_values_gets_every_name_and_its_queries_still_run():
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path.startswith("/api/v1/label/"):
            return httpx.Response(404, text="404 page not found")
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {"gpu": "0", "Hostname": "h1"}, "values": [[60.0, "35"]]}]}})

    with client_of(handler) as client:
        assert client.names_present(NAMES, 0.0, 120.0) == NAMES
        series = client.fetch(NAMES, 0.0, 120.0, 60.0)
    assert asked[0] == "/api/v1/label/__name__/values" and asked.count("/api/v1/query_range") == 2
    assert {s["metric"]["__name__"] for s in series} == set(NAMES)


def test_a_server_that_is_not_prometheus_is_told_at_the_first_query():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="<html>not here</html>")

    with client_of(handler) as client:
        assert client.names_present(NAMES, 0.0, 120.0) == NAMES
        with pytest.raises(InvalidInput, match=r"answered HTTP 404 without Prometheus's JSON .*base URL"):
            client.query_range("DCGM_FI_DEV_GPU_UTIL", 0.0, 120.0, 60.0)


def test_label_values_that_prometheus_refuses_fall_back_to_every_name():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"status": "error", "errorType": "bad_data", "error": "match[] unsupported"})

    with client_of(handler) as client:
        assert client.names_present(NAMES, 0.0, 120.0) == NAMES
