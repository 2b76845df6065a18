"""AppTest helpers: run one dashboard page, sign in through the sidebar form, read what a page shows."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from tests.ui.conftest import OPERATOR, OPERATOR_PASSWORD, UI


def page(name: str, **query: str) -> AppTest:
    at = AppTest.from_file(str(UI / "views" / f"{name}.py"), default_timeout=60)
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


def sign_in(at: AppTest, name: str = OPERATOR, password: str = OPERATOR_PASSWORD) -> AppTest:
    at.text_input(key="fl_login_name").input(name)
    at.text_input(key="fl_login_password").input(password)
    next(b for b in at.button if b.label == "Sign in").click()
    return at.run()


def button(at: AppTest, label: str, nth: int = 0):
    return [b for b in at.button if b.label == label][nth]


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def assert_clean(at: AppTest) -> None:
    assert not at.exception, texts(at.exception)
