"""Trace analysis on HolisticTraceAnalysis: one module per question over a parsed Kineto trace.

Traces are read by the streaming reader (stream_json, stream_read) in bounded memory. Entry points: `analyze_paths`
(files), `analyze_trace` / `analyze_pending` (traces registered in the store).
"""

from analyzer.traces.errors import InvalidTrace
from analyzer.traces.jobs import analyze_batch, analyze_pending, analyze_trace, pending_batches, register_trace
from analyzer.traces.run import AnalysisResult, analyze_one, analyze_paths
from analyzer.traces.stream_read import TruncatedTrace

__all__ = ["AnalysisResult", "InvalidTrace", "analyze_batch", "analyze_one", "analyze_paths", "analyze_pending",
           "analyze_trace", "pending_batches", "register_trace", "TruncatedTrace"]
