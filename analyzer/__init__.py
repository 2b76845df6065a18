"""Analysis: trace antipatterns on HTA, telemetry detectors, hourly rollups and fleet ranking."""
