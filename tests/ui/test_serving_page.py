"""The Serving page: AppTest on a seeded store (the numbers are the store's), and a real browser (Debian's
chromium through Playwright) rendering it with its charts and the right-sizing answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.serving import set_slo
from store.serving_raw import write_raw
from tests.ui.helpers import assert_clean, metrics, page, texts
from tests.ui.live_ui import CHROMIUM, ROOT, running_ui
from tests.ui.serving_seed import WORKFLOW, seed_serving


def test_serving_page_shows_the_stores_counts_and_a_right_size(empty_store) -> None:
    counts = seed_serving(empty_store)
    at = page("serving")
    assert_clean(at)
    shown = metrics(at)
    assert shown["Requests served"] == f"{sum(counts.values()):,}"
    assert shown["Requests shed"] == "8"  # one per app every fifth minute of 20
    assert shown["Devices held"] == "4"
    success = texts(at.success)
    assert "Right size:" in success and "(holds 4)" in success
    assert "Raw requests kept" not in texts(at.caption)


def test_serving_page_blames_the_slo_only_when_requests_miss_it_even_alone(empty_store) -> None:
    seed_serving(empty_store)
    with empty_store.session() as s:  # txt2img's median is 0.4 s: most of its requests run past 0.3 s alone
        set_slo(s, WORKFLOW, "txt2img", 0.3, target=0.9)
    at = page("serving")
    assert_clean(at)
    warning = texts(at.warning)
    assert "No number of devices reaches 90.0%" in warning and "run within their SLO even alone" in warning
    assert "Right size:" not in texts(at.success)


def test_serving_page_shows_the_raw_requests_kept_and_counted_over_the_cap(empty_store) -> None:
    seed_serving(empty_store)
    with empty_store.session() as s:
        write_raw(s, WORKFLOW, [{"app": "img2img", "arrival": 1.0, "wait_s": 0.0, "exec_s": 1.0, "latency_s": 1.0,
                                 "batch_size": 1}] * 5, 3)
    at = page("serving")
    assert_clean(at)
    assert "Raw requests kept: 3 stored, 2 counted over the cap" in texts(at.caption)


def test_serving_page_without_serving_data_says_how_to_record(empty_store) -> None:
    at = page("serving")
    assert_clean(at)
    assert "collector.serving" in texts(at.info)


@pytest.mark.browser
def test_serving_page_renders_in_chromium(empty_store) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (the Makefile's test target does)")
    from playwright.sync_api import expect, sync_playwright

    seed_serving(empty_store)
    with running_ui() as url:
        expect.set_options(timeout=90_000)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            try:
                pg = browser.new_page(viewport={"width": 1400, "height": 1800})
                pg.set_default_timeout(90_000)
                pg.goto(f"{url}/serving")
                expect(pg.get_by_role("heading", name="Serving", exact=True)).to_be_visible()
                expect(pg.get_by_text("Requests served").first).to_be_visible()
                expect(pg.get_by_role("heading", name="Latency against the SLO")).to_be_visible()
                expect(pg.get_by_text("Right size:", exact=False).first).to_be_visible()
                expect(pg.get_by_text("with ours (holds 4)", exact=False).first).to_be_visible()
                pg.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 2")
                pg.wait_for_timeout(1000)
                shot = ROOT / ".pytest_cache" / "serving.png"
                if shot.parent.is_dir():
                    pg.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
