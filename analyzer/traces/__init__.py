"""Trace analysis on HolisticTraceAnalysis: one module per question over a parsed Kineto trace.

Entry points: `analyze_paths` (files), `analyze_trace` / `analyze_pending` (traces registered in the store).
"""

from analyzer.traces.errors import InvalidTrace
from analyzer.traces.jobs import analyze_batch, analyze_pending, analyze_trace, pending_batches, register_trace
from analyzer.traces.run import AnalysisResult, analyze_one, analyze_paths

__all__ = ["AnalysisResult", "InvalidTrace", "analyze_batch", "analyze_one", "analyze_paths", "analyze_pending",
           "analyze_trace", "pending_batches", "register_trace"]
