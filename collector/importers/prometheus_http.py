"""Prometheus's HTTP API for the importer: query_range, chunked under Prometheus's per-series point limit, with
every failure turned into a message that says what to do."""

from __future__ import annotations

import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson

from store.errors import InvalidInput, UpstreamUnavailable

MAX_POINTS = 10_000  # Prometheus refuses a query_range of more than 11,000 points per series
FETCH_CONCURRENCY = 4
UNAVAILABLE = frozenset({429, 502, 503, 504})  # answers that say "not now", not "not here"
_RAISE = object()


class PrometheusClient:
    """Prometheus's HTTP API: query_range, with every failure turned into a message that says what to do."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, compress: bool = False) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidInput(f"{url!r} is not a Prometheus URL; give one like http://prometheus:9090")
        self.url = url.rstrip("/")
        # certificates are loaded only for https (20-40 ms each time a client is made); a plain http URL never uses
        # TLS, as redirects (to https or anywhere) are not followed
        # answers uncompressed unless asked (FLEETLENS_PROMETHEUS_COMPRESS): gzip took Prometheus two thirds of its
        # CPU for the importer's queries and made the fetch 2.5x slower on the same machine
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, verify=self.url.startswith("https://"),
                                  follow_redirects=False,
                                  headers={"Accept-Encoding": "gzip" if compress else "identity"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PrometheusClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _get(self, path: str, params: dict[str, str], *, refusal: Any = _RAISE) -> Any:
        """The `data` of Prometheus's answer to GET `path`; `refusal` instead of InvalidInput when it refuses, or
        answers without Prometheus's JSON (a compatible store or proxy without that endpoint: its 404 page)."""
        try:
            resp = self._http.get(path, params=params)
        except httpx.TimeoutException:
            raise UpstreamUnavailable(f"Prometheus at {self.url} did not answer in time; try again or raise "
                                      "FLEETLENS_PROMETHEUS_TIMEOUT_S") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"Prometheus at {self.url} cannot be reached ({exc}); check the URL and that "
                                      "Prometheus runs") from None
        try:
            body = orjson.loads(resp.content)  # a day of a fleet's series is megabytes of JSON: decode it fast
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or "status" not in body:
            if resp.status_code in UNAVAILABLE:  # a proxy in front of a Prometheus that is down, restarting or busy
                raise UpstreamUnavailable(f"{self.url} answered HTTP {resp.status_code} ({resp.reason_phrase}) to "
                                          f"{path}: Prometheus, or a proxy in front of it, is down or overloaded; "
                                          "try again later")
            if refusal is not _RAISE:
                return refusal
            raise InvalidInput(f"{self.url} answered HTTP {resp.status_code} without Prometheus's JSON to "
                               f"{path}; is this the Prometheus server's base URL?")
        if body["status"] != "success":
            if refusal is not _RAISE:
                return refusal
            raise InvalidInput(f"Prometheus at {self.url} refused the query ({body.get('errorType')}: "
                               f"{body.get('error')})")
        return body.get("data")

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """The matrix of `query` over [start, end] every `step` s: [{"metric": labels, "values": [[t, "v"]...]}]."""
        data = self._get("/api/v1/query_range", {"query": query, "start": repr(float(start)),
                                                 "end": repr(float(end)), "step": repr(float(step))}) or {}
        if data.get("resultType") != "matrix":
            raise InvalidInput(f"Prometheus at {self.url} answered a {data.get('resultType')!r}, not a matrix")
        return data.get("result") or []

    def names_present(self, names: Iterable[str], start: float, end: float) -> list[str]:
        """Those of the metrics `names` that have series in [start, end] (a superset: Prometheus answers by block),
        in the order given; one label-values call, so that a window queries only metrics the fleet exports (three of
        dcgm-exporter's sixteen fields by default) instead of asking for each of the others every window.

        A server that refuses the call (a Prometheus-compatible store without match[] on label values, or a proxy
        that answers it with a page of its own) gets every name; a wrong URL is then told by the first query."""
        names = list(names)
        data = self._get("/api/v1/label/__name__/values", {
            "match[]": "{__name__=~\"" + "|".join(re.escape(n) for n in names) + "\"}",
            "start": repr(float(start)), "end": repr(float(end))}, refusal=None)
        if not isinstance(data, list):
            return names
        present = set(data)
        return [n for n in names if n in present]

    def names_like(self, pattern: str, start: float, end: float) -> list[str]:
        """The metric names matching the regular expression `pattern` with series in [start, end], sorted ([] when
        the server refuses the call)."""
        data = self._get("/api/v1/label/__name__/values", {
            "match[]": "{__name__=~\"" + pattern + "\"}", "start": repr(float(start)), "end": repr(float(end))},
            refusal=None)
        return sorted(data) if isinstance(data, list) else []

    def fetch(self, names: Iterable[str], start: float, end: float, step: float) -> list[dict[str, Any]]:
        """Every series of the metrics `names` over [start, end], in as many query_range calls as Prometheus's
        per-series point limit asks for; the chunks of one series are joined.

        Each point is the last sample scraped in the step before it (last_over_time over one step less a
        millisecond, as Prometheus 2's ranges include both ends), not Prometheus's default of the last sample in
        five minutes: the steps tile time, so every scrape counts once and a gap longer than a step stays a gap
        instead of repeating the value before it.
        """
        chunk = step * (MAX_POINTS - 1)
        windows = []
        t = start
        while t <= end:
            windows.append((t, min(end, t + chunk)))
            t = windows[-1][1] + step
        queries = [(name, lo, hi) for name in names for lo, hi in windows]
        # Prometheus evaluates one query while this process decodes the answer to another
        with ThreadPoolExecutor(max_workers=FETCH_CONCURRENCY) as pool:
            answers = list(pool.map(
                lambda q: self.query_range(f"last_over_time({q[0]}[{max(1, round(step * 1000) - 1)}ms])", q[1], q[2],
                                           step), queries))
        merged: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for (name, _, _), answer in zip(queries, answers, strict=True):
            for series in answer:
                labels = {**series["metric"], "__name__": name}  # functions drop the metric's name
                key = tuple(sorted(labels.items()))
                if key in merged:
                    merged[key]["values"].extend(series["values"])
                else:
                    merged[key] = {"metric": labels, "values": series["values"]}
        return list(merged.values())


