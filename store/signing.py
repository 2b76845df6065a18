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
