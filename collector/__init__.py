"""The collector: device sources, workflow attribution, the per-host agent and the job-side SDK."""
