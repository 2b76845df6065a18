"""Roles: operators sign in and act; a viewer's profile, acknowledge and apply are refused on the server."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from store.models import Action, Finding, Plan, ProfileRequest
from store.settings import get_settings
from tests.ui.helpers import assert_clean, button, page, sign_in, texts
from ui.dashboard import actions
from ui.dashboard.auth import VIEWER, PermissionDenied, Principal


def _requests(store):
    with store.session() as s:
        return [(r.workflow_id, r.steps, r.requested_by, r.status) for r in s.scalars(select(ProfileRequest))]


def test_operator_profile_now_creates_the_request_and_shows_progress(seeded):
    store, _ = seeded
    at = sign_in(page("workflow", workflow="bert-finetune"))
    assert_clean(at)
    assert "Signed in as **olga** · operator" in texts(at.sidebar.markdown)
    at.number_input(key="fl_profile_steps").set_value(7)
    button(at, "Profile now").click()
    at.run()
    assert_clean(at)
    assert _requests(store) == [("bert-finetune", 7, "olga", "pending")]
    assert "Profile request" in texts(at.success)
    progress = [p for p in at.get("progress")]
    assert progress and "7 steps · pending" in progress[0].proto.text


def test_wrong_password_stays_a_viewer(seeded):
    at = sign_in(page("workflow", workflow="bert-finetune"), password="guess")
    assert "Wrong name or password" in texts(at.error)
    assert "viewer" in texts(at.sidebar.caption)


def test_viewer_profile_now_is_refused(seeded):
    store, _ = seeded
    at = page("workflow", workflow="bert-finetune")
    button(at, "Profile now").click()
    at.run()
    assert_clean(at)
    assert "only operators may trigger a profile" in texts(at.error)
    assert _requests(store) == []


def test_viewer_acknowledge_is_refused_operator_acknowledge_works(seeded):
    store, data = seeded
    fid = data.finding_ids["idle_holder"]  # the costliest, so the first card
    at = page("findings")
    button(at, "Acknowledge").click()
    at.run()
    assert "only operators may acknowledge findings" in texts(at.error)
    with store.session() as s:
        assert s.get(Finding, fid).status == "open"

    at = sign_in(page("findings"))
    button(at, "Acknowledge").click()
    at.run()
    assert_clean(at)
    with store.session() as s:
        finding = s.get(Finding, fid)
        assert (finding.status, finding.acted_by) == ("acknowledged", "olga")
    assert f"Finding {fid} is now acknowledged." in texts(at.success)


def test_viewer_apply_is_refused(seeded):
    store, data = seeded
    at = page("enforcement")
    assert_clean(at)
    at.checkbox(key="fl_confirm_pack").check().run()
    button(at, "Apply PACK plan").click()
    at.run()
    assert "only operators may apply enforcement plans" in texts(at.error)
    # whatever the page shows, the action itself refuses a viewer before it touches anything
    with pytest.raises(PermissionDenied):
        actions.apply_plan(store, VIEWER, data.plan_ids["pack"], settings=get_settings(), confirmed=True)
    with pytest.raises(PermissionDenied):
        actions.request_profile(store, Principal("eve", "viewer", "oidc"), "bert-finetune", 5)
    with pytest.raises(PermissionDenied):
        actions.set_finding_status(store, None, data.finding_ids["idle_holder"], "resolved")
    with store.session() as s:
        assert not s.get(Plan, data.plan_ids["pack"]).applied


def test_operator_applies_the_previewed_plan_only_when_confirmed(seeded):
    store, data = seeded
    at = sign_in(page("enforcement"))
    button(at, "Apply PACK plan").click()
    at.run()
    assert "tick the confirmation" in texts(at.error)
    at.checkbox(key="fl_confirm_pack").check().run()
    button(at, "Apply PACK plan").click()
    at.run()
    assert_clean(at)
    with store.session() as s:
        assert s.get(Plan, data.plan_ids["pack"]).applied
        moved = s.scalars(select(Action).where(Action.plan_id == data.plan_ids["pack"])).all()
        assert [(a.workflow_id, a.state) for a in moved] == [("bert-finetune", "planned")]
        assert not s.get(Plan, data.plan_ids["fair"]).applied
    assert f"Plan {data.plan_ids['pack']} (PACK) applied." in texts(at.success)
