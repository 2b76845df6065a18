"""A real browser on `fleetlens ui`: Debian's chromium through Playwright signs in, clicks "Profile now", and
the profile request lands in the store; the Fleet page is saved to docs/dashboard.png for the README."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from store.models import ProfileRequest
from tests.ui.conftest import OPERATOR, OPERATOR_PASSWORD
from tests.ui.live_ui import CHROMIUM, ROOT, running_ui

pytestmark = pytest.mark.browser

SCREENSHOT = ROOT / "docs" / "dashboard.png"


@pytest.fixture
def dashboard(seeded) -> Iterator[tuple[str, object]]:
    store, _ = seeded
    log = open(ROOT / ".pytest_cache" / "ui-browser.log", "w") if (ROOT / ".pytest_cache").is_dir() else None
    try:
        with running_ui(log) as url:
            yield url, store
    finally:
        if log:
            log.close()


def test_browser_profile_now_and_screenshot(dashboard):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (the Makefile's test target does)")
    from playwright.sync_api import expect, sync_playwright

    url, store = dashboard
    expect.set_options(timeout=60_000)  # a loaded machine can take a while to run a page the first time
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1480, "height": 1700})
            page.set_default_timeout(60_000)
            page.goto(f"{url}/workflow?workflow=bert-finetune")
            # the first paint is an empty skeleton: wait for the page's own content
            expect(page.get_by_role("heading", name="Workflow")).to_be_visible()
            expect(page.get_by_text("team nlp", exact=False).first).to_be_visible()

            page.get_by_text("Operator sign-in").click()
            page.get_by_label("Name").fill(OPERATOR)
            page.get_by_label("Password", exact=True).fill(OPERATOR_PASSWORD)
            page.get_by_role("button", name="Sign in").click()
            expect(page.get_by_text("Signed in as")).to_be_visible()

            page.get_by_role("tab", name="Traces & profiling").click()
            steps = page.get_by_label("Steps to capture")
            steps.fill("5")
            steps.press("Enter")
            page.get_by_role("button", name="Profile now").click()
            expect(page.get_by_text("Profile request", exact=False).first).to_be_visible()
            expect(page.get_by_text("5 steps · pending", exact=False).first).to_be_visible()
            page.wait_for_timeout(1000)
            page.screenshot(path=str(ROOT / ".pytest_cache" / "workflow.png"))

            with store.session() as s:
                rows = [(r.workflow_id, r.steps, r.requested_by, r.status) for r in s.scalars(select(ProfileRequest))]
            assert rows == [("bert-finetune", 5, OPERATOR, "pending")]

            # the Fleet page, in the same session, for the README
            page.get_by_role("link", name="Fleet").first.click()
            expect(page.get_by_role("heading", name="Fleet")).to_be_visible()
            expect(page.get_by_role("heading", name="Hosts")).to_be_visible()
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4")
            page.wait_for_timeout(1500)  # let plotly finish its transitions
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        except Exception:
            page.screenshot(path=str(ROOT / ".pytest_cache" / "browser-failure.png"))
            raise
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 20_000
