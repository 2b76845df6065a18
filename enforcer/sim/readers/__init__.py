"""Readers that turn a trace file or the store into a simulator Trace."""
