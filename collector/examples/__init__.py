"""Example training scripts that use the job SDK (tests, the demo and the enforcer's migration tests run them)."""
