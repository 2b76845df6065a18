"""HMAC-SHA256 signatures for agent commands, over canonical JSON of kind, host, payload, nonce and expiry."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any


def canonical(kind: str, host_id: str, payload: dict[str, Any], nonce: str, expires_at: float) -> bytes:
    """The exact bytes that are signed: one JSON object, keys sorted, no whitespace, ASCII only.

    The expiry is written with repr-exact float formatting so that a value read back from either database
    (a double precision column) signs to the same bytes.
    """
    doc = {"expires_at": float(expires_at), "host_id": host_id, "kind": kind, "nonce": nonce, "payload": payload}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sign(secret: bytes, kind: str, host_id: str, payload: dict[str, Any], nonce: str, expires_at: float) -> str:
    """The hex HMAC-SHA256 of the command under `secret`."""
    if not secret:
        raise ValueError("an empty key cannot sign commands; set FLEETLENS_SECRET")
    return hmac.new(secret, canonical(kind, host_id, payload, nonce, expires_at), hashlib.sha256).hexdigest()


def verify(
    secret: bytes,
    signature: str | None,
    kind: str,
    host_id: str,
    payload: dict[str, Any],
    nonce: str,
    expires_at: float,
) -> bool:
    """True only when `signature` is this command's signature under `secret` (constant-time compare)."""
    if not signature or not secret:
        return False
    try:
        expected = sign(secret, kind, host_id, payload, nonce, expires_at)
    except (TypeError, ValueError):  # a payload that is not JSON cannot have been signed by us
        return False
    return hmac.compare_digest(expected, signature)


def spec_digest(command: list[str], cwd: str, env: dict[str, str], checkpoint_dir: str | None,
                checkpoint_url: str | None) -> str:
    """The sha256 of a managed job's relaunch spec: what an agent runs, where, with which environment, and from
    which checkpoint location."""
    doc = {"checkpoint_dir": checkpoint_dir, "checkpoint_url": checkpoint_url, "command": [str(c) for c in command],
           "cwd": cwd, "env": {str(k): str(v) for k, v in env.items()}}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def sign_spec(secret: bytes, digest: str) -> str:
    """The hex HMAC-SHA256 of a relaunch spec's digest under the fleet secret."""
    if not secret:
        raise ValueError("an empty key cannot sign a relaunch spec; set FLEETLENS_SECRET")
    return hmac.new(secret, b"relaunch-spec:" + digest.encode(), hashlib.sha256).hexdigest()


def verify_spec(secret: bytes, signature: str | None, digest: str) -> bool:
    if not signature or not secret:
        return False
    return hmac.compare_digest(sign_spec(secret, digest), signature)
