"""Our trace reader (analyzer.traces.read_events) makes the very frame HTA's own parser makes, on every shared trace.

HTA's parse_trace_dataframe (JSON backend, the args the rules read) is the reference: same rows with the same index,
same columns in the same order and of the same dtypes, same values; names and categories compared decoded, since
the ids of a symbol table follow a set's order. If HTA's parser changes what it makes, these tests say so.
"""

from __future__ import annotations

import gzip
import json
import logging

import pandas as pd
import pytest

from analyzer.traces.parse import ARGS_READ
from analyzer.traces.read_events import read_events
from tests.conftest import TRACES

SHARED = sorted(p.name for p in TRACES.glob("*.json.gz"))


def _args() -> dict[str, int]:
    from hta.configs.parser_config import ParserConfig  # noqa: PLC0415  (HTA only where a test reads a trace)

    return {a.raw_name: a.default_value for a in ParserConfig.get_default_args() if a.name in ARGS_READ}


def _decoded(df: pd.DataFrame, symbols) -> pd.DataFrame:
    table = symbols.get_sym_table()
    out = df.copy()
    for col in ("cat", "name"):
        out[col] = [table[i] for i in df[col]]
    return out


def _hta_parse(path):
    from hta.common.trace_parser import parse_trace_dataframe  # noqa: PLC0415
    from hta.configs.parser_config import ParserBackend, ParserConfig  # noqa: PLC0415

    cfg = ParserConfig.get_default_cfg().clone()
    cfg.set_parser_backend(ParserBackend.JSON)
    cfg.set_args_selector(list(ARGS_READ))
    logging.getLogger("hta").setLevel(logging.ERROR)
    return parse_trace_dataframe(str(path), cfg)


@pytest.mark.parametrize("name", SHARED)
def test_the_frame_is_htas_parsers_frame(name):
    meta, df, symbols = read_events(TRACES / name, _args())
    hta_meta, hta_df, hta_symbols = _hta_parse(TRACES / name)
    assert meta == hta_meta
    assert len(df) > 0
    pd.testing.assert_frame_equal(_decoded(df, symbols), _decoded(hta_df, hta_symbols))
    assert set(symbols.get_sym_table()) == set(hta_symbols.get_sym_table())


def test_the_shared_traces_cover_what_the_reader_must_match():
    """The cases the equality above stands on are there: nanosecond timestamps (rounded), stream ids written as
    strings (ROCm), events without a duration or category (dropped), and a pid that is not a number."""
    seen = {"float_ts": False, "str_stream": False, "no_dur": False, "str_pid": False}
    for name in SHARED:
        with gzip.open(TRACES / name, "rb") as fh:
            events = json.loads(fh.read())["traceEvents"]
        for e in events:
            seen["float_ts"] |= isinstance(e.get("ts"), float)
            seen["str_stream"] |= isinstance((e.get("args") or {}).get("stream"), str)
            seen["no_dur"] |= "dur" not in e
            seen["str_pid"] |= isinstance(e.get("pid"), str)
    assert all(seen.values()), seen


def test_a_counter_mode_trace_with_gaps_reads_as_hta_reads_it(tmp_path):
    # CUPTI counter mode (cuda_profiler_range events; with the args chosen, HTA lifts no counter columns) and a
    # metadata event without ts or dur: the gaps make ts and dur float in HTA's frame; a kept event without a tid
    events = [
        {"ph": "X", "cat": "cuda_profiler_range", "name": "range", "pid": 0, "tid": 1, "ts": 10, "dur": 5,
         "args": {"sm__cycles_active.avg": 123, "dram__bytes_read.sum": 9}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 11, "dur": 2, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "ts": 14, "dur": 1},  # no tid, no args
        {"ph": "M", "name": "process_name", "pid": "Spans", "tid": 0, "args": {"name": "x"}},
    ]
    path = tmp_path / "counters.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    meta, df, symbols = read_events(path, _args())
    hta_meta, hta_df, hta_symbols = _hta_parse(path)
    assert meta == hta_meta == {"schemaVersion": 1}
    assert df["ts"].tolist() == [10.0, 11.0, 14.0] and "sm__cycles_active.avg" not in df
    assert df["tid"].isna().tolist() == [False, False, True] and df["stream"].tolist() == [-1, -1, -1]
    pd.testing.assert_frame_equal(_decoded(df, symbols), _decoded(hta_df, hta_symbols))
