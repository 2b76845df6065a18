"""Serving simulator: request traces (Alibaba diffusion serving, Azure LLM), the batch-serving event loop, the
baseline schedulers (simulator only) and the benchmark's configurations."""
