"""Operator hashes, the operators setting, OIDC operators, and `fleetlens ui-passwd`."""

from __future__ import annotations

import io

import pytest

from store.errors import ConfigError
from ui.cli import run
from ui.dashboard.auth import (
    VIEWER,
    PermissionDenied,
    authenticate,
    hash_password,
    oidc_principal,
    parse_operators,
    require_operator,
    verify_password,
)


def test_hash_round_trip_and_wrong_password():
    encoded = hash_password("s3cret", iterations=1000)
    assert encoded.startswith("pbkdf2_sha256$1000$")
    assert verify_password("s3cret", encoded)
    assert not verify_password("s3cret ", encoded)
    assert not verify_password("s3cret", "pbkdf2_sha256$1000$garbage")


def test_parse_operators_and_authenticate():
    ops = parse_operators(f"olga:{hash_password('pw', iterations=1000)}, boss@example.com:oidc")
    assert set(ops) == {"olga", "boss@example.com"}
    assert authenticate(ops, "olga", "pw").is_operator
    assert authenticate(ops, "olga", "nope") is None
    assert authenticate(ops, "boss@example.com", "oidc") is None  # an OIDC entry has no password
    assert oidc_principal(ops, "boss@example.com").is_operator
    assert not oidc_principal(ops, "intern@example.com").is_operator


@pytest.mark.parametrize("spec", ["olga", "olga:", ":pbkdf2_sha256$1$a$b", "olga:md5$1$a$b"])
def test_malformed_operator_entries(spec):
    with pytest.raises(ConfigError, match="FLEETLENS_UI_OPERATORS"):
        parse_operators(spec)


def test_require_operator():
    with pytest.raises(PermissionDenied, match="only operators may apply"):
        require_operator(VIEWER, "apply plans")


def test_ui_passwd_prints_a_usable_entry(fleet_home, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hunter2\n"))
    assert run(["ui-passwd", "olga", "--password-stdin"]) == 0
    entry = capsys.readouterr().out.strip().splitlines()[0]
    ops = parse_operators(entry)
    assert authenticate(ops, "olga", "hunter2").name == "olga"
    assert run(["ui-passwd", "ol:ga", "--password-stdin"]) == 2


def test_ui_refuses_a_port_that_is_not_one(fleet_home, capsys):
    assert run(["ui", "--port", "70000"]) == 2
    assert "--port 70000 is not a TCP port" in capsys.readouterr().err
