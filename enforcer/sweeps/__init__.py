"""Hyper-parameter sweeps: the Fluid allocator (trial widths) and the speed model it plans with."""
