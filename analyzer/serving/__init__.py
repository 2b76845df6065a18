"""Serving workflows judged by latency: the three serving rules and the replay the over-provisioning rule uses."""
