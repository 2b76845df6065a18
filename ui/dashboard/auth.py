"""Dashboard roles: operator password hashes (PBKDF2-SHA256), OIDC users, and the server-side role check.

Everyone who can open the dashboard is a viewer. Operators are named in FLEETLENS_UI_OPERATORS as
`name:pbkdf2_sha256$iterations$salt$hash` (make one with `fleetlens ui-passwd NAME`), or, when Streamlit's
OIDC login is configured ([auth] in .streamlit/secrets.toml), as `email:oidc` for a user who signs in with
`st.login`. The action functions in ui.dashboard.actions call `require_operator`, so a viewer's click is refused on
the server whatever the page shows.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from store.errors import ConfigError, FleetlensError

ALGORITHM = "pbkdf2_sha256"
DEFAULT_ITERATIONS = 600_000  # OWASP's 2023 figure for PBKDF2-HMAC-SHA256
OIDC_MARK = "oidc"


class PermissionDenied(FleetlensError):
    """A viewer tried an operator action (profile, acknowledge, apply)."""


@dataclass(frozen=True)
class Principal:
    """Who is looking at the dashboard: a name (or None for an anonymous viewer) and a role."""

    name: str | None = None
    role: str = "viewer"  # viewer | operator
    via: str = "anonymous"  # anonymous | password | oidc

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"

    @property
    def label(self) -> str:
        return self.name or "anonymous viewer"


VIEWER = Principal()


def hash_password(password: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> str:
    """`pbkdf2_sha256$iterations$salt$hash` with url-safe base64 salt and hash (no `:` or `,` inside)."""
    if not password:
        raise ConfigError("an operator password cannot be empty")
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    b64 = lambda b: base64.urlsafe_b64encode(b).decode().rstrip("=")  # noqa: E731
    return f"{ALGORITHM}${iterations}${b64(salt)}${b64(digest)}"


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def verify_password(password: str, encoded: str) -> bool:
    try:
        algorithm, iterations, salt, digest = encoded.split("$")
        if algorithm != ALGORITHM:
            return False
        expected = _unb64(digest)
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), _unb64(salt), int(iterations))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


def parse_operators(spec: str) -> dict[str, str]:
    """FLEETLENS_UI_OPERATORS as {name: hash or 'oidc'}; a malformed entry is a ConfigError naming it."""
    operators: dict[str, str] = {}
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, secret = entry.partition(":")
        name, secret = name.strip(), secret.strip()
        valid_hash = secret.startswith(f"{ALGORITHM}$") and secret.count("$") == 3
        if not sep or not name or not (valid_hash or secret == OIDC_MARK):
            shown = name or entry[:20]
            raise ConfigError(
                f"FLEETLENS_UI_OPERATORS entry {shown!r} is not `name:{ALGORITHM}$iterations$salt$hash` "
                f"or `email:{OIDC_MARK}`; make a hash with `fleetlens ui-passwd NAME`"
            )
        operators[name] = secret
    return operators


def authenticate(operators: dict[str, str], name: str, password: str) -> Principal | None:
    """The operator if the password matches their hash; None otherwise (same answer for unknown names)."""
    encoded = operators.get(name.strip())
    if encoded is None or encoded == OIDC_MARK:
        # Spend the same time as a real check so a caller cannot tell which names exist.
        verify_password(password, hash_password("x", salt=b"0" * 16))
        return None
    return Principal(name.strip(), "operator", "password") if verify_password(password, encoded) else None


def oidc_principal(operators: dict[str, str], email: str | None, name: str | None = None) -> Principal:
    """A user signed in through OIDC: an operator if their email is listed as `email:oidc`, else a viewer."""
    ident = email or name
    if ident and operators.get(ident) == OIDC_MARK:
        return Principal(ident, "operator", "oidc")
    return Principal(ident, "viewer", "oidc")


def require_operator(principal: Principal | None, what: str) -> Principal:
    """Refuse `what` unless the principal is an operator; every state-changing dashboard action calls this."""
    if principal is None or not principal.is_operator:
        who = principal.label if principal else "an anonymous viewer"
        raise PermissionDenied(
            f"only operators may {what}; {who} is a viewer. Sign in as an operator in the sidebar "
            "(operators are listed in FLEETLENS_UI_OPERATORS)"
        )
    return principal
