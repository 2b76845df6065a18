"""Actuators: one per engine that can carry out a planned move (see base.py for the seam)."""
