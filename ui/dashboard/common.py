"""What every dashboard page shares: the store, the signed-in principal, the time window, cached queries, banners."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import streamlit as st

from store.db import Store
from store.errors import ConfigError, DatabaseUnavailable, FleetlensError, SchemaError
from store.migrations import check_schema
from store.settings import Settings, get_settings
from ui.dashboard import queries, state_queries, workflow_queries
from ui.dashboard.auth import VIEWER, Principal, authenticate, oidc_principal, parse_operators
from ui.dashboard.queries import Window

WINDOWS = {"1 hour": 3600, "6 hours": 6 * 3600, "24 hours": 86400, "7 days": 7 * 86400}
DEFAULT_WINDOW = "24 hours"
PRINCIPAL_KEY = "fl_principal"
CACHE_TTL_S = 60

EMPTY_STORE_HELP = """
**No devices have reported yet.** fleetlens fills this page from the agents that sample your GPUs.

1. Create the database once: `fleetlens init`
2. On every GPU host, start the agent: `fleetlens agent` (it registers the host and its devices, then samples
   them every second; on a machine without a GPU it samples CPU cores instead)
3. Optionally start training jobs under fleetlens so they can be profiled and moved: `fleetlens run -- python train.py`

Then reload this page.
"""


@dataclass
class Context:
    settings: Settings
    store: Store
    url: str
    principal: Principal
    window: Window
    window_label: str
    state: dict[str, int]

    @property
    def empty(self) -> bool:
        return not (self.state["hosts"] or self.state["has_samples"] or self.state["has_rollups"])


@st.cache_resource(show_spinner=False)
def store_for(url: str) -> Store:
    return Store(url)


QUERY_MODULES = (queries, workflow_queries, state_queries)  # where a page's query is found by name


def query(name: str) -> Any:
    """The dashboard query of this name (ui.dashboard.queries, workflow_queries or state_queries)."""
    for module in QUERY_MODULES:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    raise AttributeError(f"no dashboard query {name!r}")


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False, max_entries=256)
def _cached(name: str, url: str, args: tuple, kwargs: tuple) -> Any:
    return query(name)(store_for(url), *args, **dict(kwargs))


def cached(ctx: Context, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run queries.<name> through st.cache_data, keyed on the store URL and the arguments (the time window)."""
    return _cached(name, ctx.url, args, tuple(sorted(kwargs.items())))


def fresh(ctx: Context, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run queries.<name> uncached: for state an action just changed (findings, profile requests, actions)."""
    return query(name)(ctx.store, *args, **kwargs)


def clear_cache() -> None:
    _cached.clear()


def operators(settings: Settings) -> dict[str, str]:
    try:
        return parse_operators(settings.ui_operators)
    except ConfigError as exc:
        st.sidebar.error(str(exc))
        return {}


def _oidc_configured() -> bool:
    try:
        return "auth" in st.secrets
    except Exception:  # no secrets.toml at all: Streamlit raises its own FileNotFound flavour
        return False


def _sidebar_auth(settings: Settings) -> Principal:
    ops = operators(settings)
    principal: Principal = st.session_state.get(PRINCIPAL_KEY, VIEWER)
    user = getattr(st, "user", None)
    if principal.via != "password" and _oidc_configured() and user is not None and user.is_logged_in:
        principal = oidc_principal(ops, user.get("email"), user.get("name"))
    box = st.sidebar.container(border=True)
    if principal.is_operator:
        box.markdown(f"Signed in as **{principal.name}** · operator")
        if box.button("Sign out", key="fl_sign_out"):
            st.session_state.pop(PRINCIPAL_KEY, None)
            if principal.via == "oidc":
                st.logout()
            st.rerun()
        return principal
    box.caption(f"{principal.label.capitalize()} · viewer (read-only)")
    if _oidc_configured():
        if box.button("Sign in with SSO", key="fl_sso"):
            st.login()
    with box.expander("Operator sign-in", expanded=False):
        with st.form("fl_login", clear_on_submit=True, border=False):
            name = st.text_input("Name", key="fl_login_name")
            password = st.text_input("Password", type="password", key="fl_login_password")
            if st.form_submit_button("Sign in"):
                signed = authenticate(ops, name, password) if ops else None
                if signed is None:
                    st.error("Wrong name or password." if ops else
                             "No operators are configured (FLEETLENS_UI_OPERATORS).")
                else:
                    st.session_state[PRINCIPAL_KEY] = signed
                    st.rerun()
    return principal


def bootstrap() -> Context | None:
    """Open the store and check it, draw the sidebar; None (with a banner shown) when nothing can be read."""
    try:
        settings = get_settings(fresh=True)
        url = settings.resolved_db_url
        store = store_for(url)
        check_schema(store)
        state = queries.store_state(store)
    except DatabaseUnavailable as exc:
        st.error(f"**Database unavailable.** {exc}", icon=":material/error:")
        return None
    except SchemaError as exc:
        st.error(f"**The database has no usable fleetlens schema.** {exc}", icon=":material/error:")
        return None
    except FleetlensError as exc:
        st.error(f"**fleetlens is not configured.** {exc}", icon=":material/error:")
        return None
    principal = _sidebar_auth(settings)
    label = st.sidebar.selectbox("Time window", list(WINDOWS), index=list(WINDOWS).index(DEFAULT_WINDOW),
                                 key="fl_window")
    window = Window.last(WINDOWS[label])
    st.sidebar.caption(f"{rollup_caption(state) if window.uses_rollups else 'raw samples'} · {store.masked_url}")
    ctx = Context(settings, store, url, principal, window, label, state)
    return ctx


def rollup_caption(state: dict[str, int]) -> str:
    """What a long window shows: hourly rollups, up to the last hour `fleetlens rollup` has closed."""
    if not state.get("rolled_up_to"):
        return "hourly rollups (none written yet: `fleetlens rollup`)"
    to = datetime.fromtimestamp(state["rolled_up_to"], tz=UTC)
    return f"hourly rollups up to {to:%Y-%m-%d %H:%M} UTC"


def context() -> Context:
    """Start a page: bootstrap the store and sidebar (stop with the banner shown when it cannot), show any flash.

    Each page calls this itself, so a page works under st.navigation and when run on its own (AppTest).
    """
    ctx = bootstrap()
    if ctx is None:
        st.stop()
    if flash := st.session_state.pop("fl_flash", None):
        st.success(flash, icon=":material/check_circle:")
    return ctx


def device_page(title: str) -> Context:
    """Start a page that shows devices' data: context(), the title, and the first-run help (then stop) while no
    device has reported yet."""
    ctx = context()
    st.title(title)
    if ctx.empty:
        st.info(EMPTY_STORE_HELP, icon=":material/sensors:")
        st.stop()
    return ctx


def report(exc: BaseException) -> None:
    """Show a user error as a banner (database down mid-page included); anything else propagates."""
    if isinstance(exc, DatabaseUnavailable):
        st.error(f"**Database unavailable.** {exc}", icon=":material/error:")
    else:
        st.error(str(exc))


def ago(ts: float | None, now: float | None = None) -> str:
    if ts is None or ts != ts:
        return "never"
    s = max(0.0, (time.time() if now is None else now) - float(ts))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def fmt_hours(x: float) -> str:
    return f"{x:,.1f}"
