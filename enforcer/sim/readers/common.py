"""Shared reader plumbing: open a CSV with pandas, insist on the columns a reader needs, count bad rows."""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from store.errors import InvalidInput


def _open_text(path: Path):
    return gzip.open(path, "rt", errors="replace") if path.suffix == ".gz" else open(path, errors="replace")


def data_lines(path: Path, header: bool) -> int:
    """Non-blank data lines in the file: what pandas should have parsed if every row were well formed."""
    with _open_text(path) as fh:
        n = sum(1 for line in fh if line.strip())
    return max(0, n - (1 if header else 0))


def require_file(path: Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{what}: {path} is not a file; give the path of the {what} CSV")
    return path


def read_csv(
    path: Path, what: str, expected: Sequence[str], *, header: bool = True
) -> tuple[pd.DataFrame, int]:
    """The file as a DataFrame with at least the `expected` columns, and how many lines pandas had to skip.

    A file whose header (or, without a header, whose first row) lacks the expected columns raises
    InvalidInput naming the columns expected and the ones found. Lines with too many fields are skipped and
    counted; the caller counts rows whose values do not parse.
    """
    path = require_file(path, what)
    try:
        if header:
            df = pd.read_csv(path, on_bad_lines="skip", dtype=str, keep_default_na=False)
            found = [str(c) for c in df.columns]
        else:
            # header-less: the first row says how many fields the file has
            first = pd.read_csv(path, header=None, nrows=1, dtype=str)
            found = [f"field {i + 1}" for i in range(first.shape[1])]
            if first.shape[1] < len(expected):
                raise InvalidInput(
                    f"{what} {path}: expected {len(expected)} columns ({', '.join(expected)}), "
                    f"found {first.shape[1]} ({', '.join(found)})"
                )
            df = pd.read_csv(
                path,
                header=None,
                names=list(expected) + [f"_extra{i}" for i in range(first.shape[1] - len(expected))],
                on_bad_lines="skip",
                dtype=str,
                keep_default_na=False,
            )
    except pd.errors.EmptyDataError:
        raise InvalidInput(f"{what} {path} is empty; expected columns {', '.join(expected)}") from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, EOFError) as exc:
        raise InvalidInput(f"{what} {path} cannot be read as CSV: {exc}") from None
    missing = [c for c in expected if c not in df.columns]
    if missing:
        raise InvalidInput(
            f"{what} {path} lacks the columns {', '.join(missing)}: expected {', '.join(expected)}; "
            f"found {', '.join(found) or 'none'}"
        )
    skipped = max(0, data_lines(path, header) - len(df))
    return df, skipped


def numeric(df: pd.DataFrame, columns: Sequence[str], optional: Sequence[str] = ()) -> tuple[pd.DataFrame, int]:
    """`df` with `columns` parsed as numbers; rows where a required one does not parse to a finite number ("inf"
    parses, and is no time, size or count) are dropped and counted."""
    out = df.copy()
    for c in list(columns) + list(optional):
        out[c] = pd.to_numeric(out[c].str.strip() if out[c].dtype == object else out[c], errors="coerce")
    bad = ~np.isfinite(out[list(columns)].astype("float64")).all(axis=1)
    return out[~bad], int(bad.sum())
