"""Importers of telemetry other systems already hold (a fleet's Prometheus with dcgm-exporter), into the store."""
