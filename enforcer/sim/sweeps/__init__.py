"""The sweep simulator: tuners (grid, synchronous successive halving, ASHA) on benchmark train times, run under
one trial per GPU (Ray's default) and under the Fluid allocator, static and dynamic."""
