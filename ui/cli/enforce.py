"""`fleetlens enforce` (plan, and with --apply record the moves) and `fleetlens lanes` (lanes per device)."""

from __future__ import annotations

from collections import defaultdict

import typer
from rich.table import Table
from sqlalchemy import select

from enforcer.consolidation_store import POLICY as CONSOLIDATE
from enforcer.consolidation_store import make_consolidation_plan
from enforcer.plan_store import TERMINAL_ACTION_STATES, make_plan
from enforcer.policies import get_policy
from store.headroom import charged
from store.models import Action, Device, Lane, Placement
from ui.cli.app import app, console, open_store, settings

GIB = 2**30


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


@app.command()
def enforce(
    policy: str = typer.Option(None, "--policy", help="pack (fewest devices), fair (spread), or consolidate "
                               "(re-pack by observed demand); default: setting"),
    apply: bool = typer.Option(False, "--apply", help="record the moves as planned actions (default: dry run)"),
) -> None:
    """Plan moves of idle and underused movable jobs into shared lanes, and show which devices come free."""
    s = settings()
    name = policy or s.policy
    if name.strip().lower() == CONSOLIDATE:
        _consolidate(apply or s.enforce)
        return
    get_policy(name)  # an unknown policy is a one-line error before the database is touched
    store = open_store()
    result = make_plan(store, name, apply=apply or s.enforce, settings=s)
    title = f"plan {result.plan_id} ({result.policy}{', applied' if result.applied else ', dry run'})"
    table = Table(title=title)
    for column in ("job", "from", "to", "lane", "lane size", "compute share", "expected slowdown", "why"):
        table.add_column(column)
    for m in result.moves:
        table.add_row(m.workflow_id, str(m.from_device_id), str(m.to_device_id),
                      str(m.to_lane_id) if m.to_lane_id is not None else f"{m.new_lane} (new)",
                      _gib(m.lane_size), f"{m.compute_share:.0%}", f"{m.expected_slowdown:.2f}x", ", ".join(m.rules))
    console.print(table)
    freed = ", ".join(str(d) for d in result.devices_freed) or "none"
    console.print(f"devices freed: {len(result.devices_freed)} ({freed})")
    if result.skipped:
        console.print("not moved: " + ", ".join(f"{n} {why}" for why, n in sorted(result.skipped.items())))
    _not_heard_from(result.not_heard_from, result.closed)
    if result.moves and not result.applied:
        console.print("dry run: nothing moves; `fleetlens enforce --apply` records these moves for the enforcer")


def _consolidate(apply: bool) -> None:
    """One consolidation cycle by hand: the moves with their reason, and the devices they give back."""
    s = settings()
    plan_id, plan = make_consolidation_plan(open_store(), s, apply=apply)
    table = Table(title=f"plan {plan_id} (consolidate{', applied' if apply and plan.moves else ', dry run'})")
    for column in ("job", "from", "to", "why", "cost (s)", "device-hours back"):
        table.add_column(column)
    for m in plan.moves:
        table.add_row(m.job_id, str(m.from_device_id), str(m.to_device_id), m.reason, f"{m.cost_s:.0f}",
                      f"{m.gain_device_h:.2f}")
    console.print(table)
    console.print(f"devices held {plan.devices_held}, after the moves {plan.devices_needed}; freed: "
                  f"{', '.join(map(str, plan.devices_freed)) or 'none'}")
    for job, why in sorted(plan.unresolved.items()):
        console.print(f"{job}: {why}")
    for refusal in plan.refused:
        console.print(f"{refusal['workflow_id']} stays on device {refusal['from_device_id']}: {refusal['reason']}")
    if plan.skipped:
        console.print("not moved: " + ", ".join(f"{n} {why}" for why, n in sorted(plan.skipped.items())))
    _not_heard_from(plan.not_heard_from, plan.closed)


def _not_heard_from(hosts: dict[str, str], closed: dict[str, str]) -> None:
    for host, why in sorted(hosts.items()):
        console.print(f"left alone: host {host} {why}")
    for host, why in sorted(closed.items()):
        console.print(f"no job moved onto host {host}: it {why}")


@app.command()
def lanes() -> None:
    """Lanes per device, with their size, compute share and jobs."""
    store = open_store()
    with store.session() as session:
        devices = {d.id: d for d in session.scalars(select(Device))}
        open_lanes = list(session.scalars(select(Lane).where(Lane.state == "open").order_by(Lane.device_id, Lane.id)))
        jobs: dict[int, list[str]] = defaultdict(list)
        used: dict[int, int] = defaultdict(int)
        whole: dict[int, list[str]] = defaultdict(list)
        for p in session.scalars(select(Placement).where(Placement.state == "active").order_by(Placement.id)):
            if p.lane_id is None:
                whole[p.device_id].append(p.workflow_id)
            else:
                jobs[p.lane_id].append(p.workflow_id)
                used[p.lane_id] += charged(p.mem_persistent or 0) + (p.mem_ephemeral or 0)
        arriving: dict[int, list[str]] = defaultdict(list)
        for a in session.scalars(select(Action).where(Action.to_lane_id.is_not(None),
                                                      Action.state.not_in(TERMINAL_ACTION_STATES))):
            arriving[a.to_lane_id].append(f"{a.workflow_id} (arriving, {a.state})")
        table = Table(title="lanes")
        for column in ("device", "lane", "size", "used", "compute share", "jobs"):
            table.add_column(column)
        for lane in open_lanes:
            d = devices.get(lane.device_id)
            label = f"{d.host_id}:{d.index} {d.name}" if d else str(lane.device_id)
            table.add_row(label, str(lane.id), _gib(lane.size_bytes), _gib(used[lane.id]),
                          f"{lane.compute_share:.0%}", ", ".join(jobs[lane.id] + arriving[lane.id]) or "(empty)")
        for device_id, names in sorted(whole.items()):
            d = devices.get(device_id)
            label = f"{d.host_id}:{d.index} {d.name}" if d else str(device_id)
            table.add_row(label, "whole device", _gib(d.memory_total if d else None), "", "100%", ", ".join(names))
    if not open_lanes and not whole:
        console.print("no lanes and no placed jobs yet (`fleetlens run` places managed jobs)")
        return
    console.print(table)
