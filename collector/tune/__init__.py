"""Ray Tune under Fluid: the scheduler a tuner's driver process uses (needs the `tune` extra)."""
