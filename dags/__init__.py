"""fleetlens's Airflow DAG files: thin wiring, each task one call into the analyzer, enforcer and store packages."""
