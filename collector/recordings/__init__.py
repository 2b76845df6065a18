"""Recordings of a fleet's telemetry: reading them, loading them into a store, and exporting a store to one.

- ``recording``: the in-memory Recording every reader returns and every consumer takes.
- ``alibaba``: the Alibaba GenAI cluster trace reader.
- ``export_format``, ``export_writer``, ``export_reader``: fleetlens's own export format, written and read.
- ``read``: ``read_recording``, which tells the kinds apart and reads any of them.
- ``load``: ``load_into_store``, a whole recording written into a store at once.
- ``openmetrics_writer``: a recording as OpenMetrics under dcgm-exporter's names (to backfill a Prometheus).

Playing one recording live as a device source is collector.sources.replay.
"""
