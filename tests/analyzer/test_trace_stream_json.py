"""The incremental JSON decode (analyzer.traces.stream_json): every event of a valid trace, whatever its strings
hold or however its gzip file ends; text that is not JSON named as such."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from analyzer.traces.stream_json import EventStream, TraceCut

BLOCK = 1 << 16


def _events(n: int) -> list[dict]:
    # labels holding JSON (a `},{` in a string, many per event), escaped backslashes before a closing quote, and
    # args holding a list of objects (a `},{` outside strings but inside an event)
    return [{"ph": "X", "cat": "user_annotation", "ts": i, "dur": 1, "pid": 1, "tid": 1,
             "name": f"cfg {i} " + '{"a":1},{"b":"\\\\"}' * 40 + "\\",
             "args": {"parts": [{"x": j} for j in range(12)], "note": "},{" * 10}} for i in range(n)]


def _read(path: Path, block: int = BLOCK) -> list[dict]:
    return [e for batch in EventStream(path, block_bytes=block).batches() for e in batch]


@pytest.mark.parametrize("indent", [False, True])
def test_brackets_and_cut_marks_inside_strings_or_nested_objects_are_no_event_ends(tmp_path, indent):
    events = _events(3000)
    path = tmp_path / "strings.json"
    path.write_bytes(orjson.dumps({"traceEvents": events, "deviceProperties": []},
                                  option=orjson.OPT_INDENT_2 if indent else 0))
    assert _read(path) == events


def test_text_that_stops_being_json_after_such_events_is_named(tmp_path):
    text = orjson.dumps({"traceEvents": _events(3000)})
    path = tmp_path / "corrupt.json"
    path.write_bytes(text.replace(b'"ts":1500,', b'"ts":@@@@,'))
    with pytest.raises(TraceCut) as err:
        _read(path)
    assert "not valid JSON" in err.value.problem and 0 < err.value.events <= 1500


def test_zero_padding_after_the_gzip_member_is_read_as_the_gzip_module_reads_it(tmp_path):
    events = _events(500)
    path = tmp_path / "padded.json.gz"
    path.write_bytes(gzip.compress(orjson.dumps({"traceEvents": events})) + b"\0" * 5000)
    assert len(orjson.loads(gzip.open(path).read())["traceEvents"]) == 500
    assert _read(path) == events
    # padding between two members too
    half = orjson.dumps({"traceEvents": events})
    path.write_bytes(gzip.compress(half[:1000]) + b"\0" * 700 + gzip.compress(half[1000:]) + b"\0" * 3)
    assert _read(path) == events


def test_garbage_after_the_gzip_member_is_still_refused(tmp_path):
    path = tmp_path / "garbage.json.gz"
    path.write_bytes(gzip.compress(orjson.dumps({"traceEvents": _events(50)})) + b"\0\0junk")
    with pytest.raises(TraceCut, match="not valid gzip"):
        _read(path)


@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_lone_surrogate_escape_is_named_not_called_a_cut(tmp_path, where):
    events = _events(1000)
    events[500 if where == "middle" else 998]["name"] = "LONE"
    path = tmp_path / "surrogate.json"
    path.write_bytes(orjson.dumps({"traceEvents": events}).replace(b'"LONE"', b'"x\\ud83dy"'))
    with pytest.raises(TraceCut) as err:
        _read(path)
    assert "surrogate" in err.value.problem and "truncated" not in err.value.problem
