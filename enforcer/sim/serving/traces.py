"""Request traces for the serving simulator, read in place: Alibaba's Stable Diffusion serving requests (real
execution times) and Azure's LLM inference arrivals (token counts; times from a stated token-to-time model).

Rows that cannot be used are counted in `skipped` by reason, never silently dropped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from store.errors import InvalidInput

ALIBABA_FILE = "alibaba_genai_lora_request_trace.csv.gz"
AZURE_FILES = {"code": "azure_llm_inference_2023_code.csv.gz", "conv": "azure_llm_inference_2023_conv.csv.gz"}

# Token-to-time model for Azure's LLM traces (which carry no times): one request runs alone for
#   PREFILL_S_PER_TOKEN * context tokens + DECODE_S_PER_TOKEN * generated tokens + OVERHEAD_S,
# i.e. prefill at 10,000 tokens/s and 30 ms per generated token, a 7-13B model on one A100-class GPU in the range
# public serving measurements report. It is stated, not calibrated here (no GPU on this machine).
PREFILL_S_PER_TOKEN = 1e-4
DECODE_S_PER_TOKEN = 0.03
OVERHEAD_S = 0.05


@dataclass
class RequestTrace:
    """One row per usable request, sorted by arrival: arrival (s, from the trace's first request), app and group
    names (application; batching group = model), true execution time (s)."""

    name: str
    arrival: np.ndarray
    app: np.ndarray
    group: np.ndarray
    time: np.ndarray
    rows: int = 0
    skipped: Counter = field(default_factory=Counter)
    notes: dict = field(default_factory=dict)

    def split(self, frac: float = 0.5) -> tuple[RequestTrace, RequestTrace]:
        """The first `frac` of the trace's span and the rest (fit on the first, score on the second)."""
        cut = self.arrival[0] + frac * (self.arrival[-1] - self.arrival[0])
        k = int(np.searchsorted(self.arrival, cut, side="right"))
        return self._take(slice(0, k), "fit"), self._take(slice(k, None), "score")

    def _take(self, sl: slice, part: str) -> RequestTrace:
        return RequestTrace(f"{self.name}:{part}", self.arrival[sl], self.app[sl], self.group[sl], self.time[sl])


def _require(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"serving trace: {path} is not a file; point at /work/shared/data/serving or a copy")
    return path


def read_alibaba_requests(path: Path) -> RequestTrace:
    """Successful requests; application = base model x task type, batching group = base model. FAILED, PENDING
    and PROCESSING rows, and rows with a missing model, type or time or a time <= 0, are counted in `skipped`."""
    path = _require(path if not Path(path).is_dir() else Path(path) / ALIBABA_FILE)
    try:
        df = pd.read_csv(path, usecols=["gmt_create", "predict_type", "predict_status", "exec_time_seconds",
                                        "checkpoint_model_version_id"])
    except (ValueError, pd.errors.ParserError) as exc:
        raise InvalidInput(f"Alibaba request trace {path}: {exc}") from exc
    trace = RequestTrace("alibaba", np.array([]), np.array([]), np.array([]), np.array([]), rows=len(df))
    status = df["predict_status"].astype(str)
    for s, c in status[status != "SUCCEED"].value_counts().items():
        trace.skipped[f"status_{s.lower()}"] += int(c)
    df = df[status == "SUCCEED"]
    ts = pd.to_datetime(df["gmt_create"], errors="coerce", utc=True)
    t = pd.to_numeric(df["exec_time_seconds"], errors="coerce")
    bad_time = ~(t > 0)
    bad_app = df["predict_type"].isna() | df["checkpoint_model_version_id"].isna()
    bad_ts = ts.isna()
    trace.skipped["no_application"] += int(bad_app.sum())
    trace.skipped["time_not_positive"] += int((bad_time & ~bad_app).sum())
    trace.skipped["bad_timestamp"] += int((bad_ts & ~bad_time & ~bad_app).sum())
    keep = ~(bad_time | bad_app | bad_ts)
    df, ts, t = df[keep], ts[keep], t[keep]
    order = np.argsort(ts.to_numpy(), kind="stable")
    secs = (ts - ts.min()).dt.total_seconds().to_numpy()[order]
    model = df["checkpoint_model_version_id"].astype(str).to_numpy()[order]
    kind = df["predict_type"].astype(str).to_numpy()[order]
    trace.arrival = secs
    trace.app = np.char.add(np.char.add(model.astype(str), "/"), kind.astype(str))
    trace.group = model
    trace.time = t.to_numpy(dtype=float)[order]
    return trace


def read_azure_requests(path: Path, kind: str | None = None) -> RequestTrace:
    """Azure LLM requests as one application (the service); times from the token-to-time model above. Rows with
    a bad timestamp or negative token counts are counted in `skipped`."""
    p = Path(path)
    if p.is_dir():
        if kind not in AZURE_FILES:
            raise InvalidInput(f"Azure trace kind {kind!r}: one of {sorted(AZURE_FILES)}")
        p = p / AZURE_FILES[kind]
    kind = kind or ("code" if "code" in p.name else "conv")
    p = _require(p)
    try:
        df = pd.read_csv(p)
    except (ValueError, pd.errors.ParserError) as exc:
        raise InvalidInput(f"Azure LLM trace {p}: {exc}") from exc
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(df.columns)
    if missing:
        raise InvalidInput(f"Azure LLM trace {p}: missing columns {sorted(missing)}")
    trace = RequestTrace(f"azure_{kind}", np.array([]), np.array([]), np.array([]), np.array([]), rows=len(df))
    ts = pd.to_datetime(df["TIMESTAMP"], errors="coerce", utc=True)
    ctx = pd.to_numeric(df["ContextTokens"], errors="coerce")
    gen = pd.to_numeric(df["GeneratedTokens"], errors="coerce")
    bad_ts, bad_tok = ts.isna(), ~((ctx >= 0) & (gen >= 0))
    trace.skipped["bad_timestamp"] += int(bad_ts.sum())
    trace.skipped["bad_token_count"] += int((bad_tok & ~bad_ts).sum())
    keep = ~(bad_ts | bad_tok)
    ts, ctx, gen = ts[keep], ctx[keep].to_numpy(float), gen[keep].to_numpy(float)
    order = np.argsort(ts.to_numpy(), kind="stable")
    trace.arrival = (ts - ts.min()).dt.total_seconds().to_numpy()[order]
    trace.time = (PREFILL_S_PER_TOKEN * ctx + DECODE_S_PER_TOKEN * gen + OVERHEAD_S)[order]
    trace.app = np.full(len(order), kind, dtype=object).astype(str)
    trace.group = trace.app.copy()
    trace.notes["token_to_time"] = (f"t = {PREFILL_S_PER_TOKEN:g} s x context + {DECODE_S_PER_TOKEN:g} s x "
                                    f"generated + {OVERHEAD_S:g} s")
    return trace
