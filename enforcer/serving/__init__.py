"""Serving: our reconstruction of Orloj's distribution-aware batch scheduler (the policy, the per-application
execution-time distributions it plans with, and the in-process request queue a serving loop calls)."""
