"""The collector: device sources, workflow attribution, the per-host agent, starting and finding managed jobs'
processes, and the job-side SDK."""
