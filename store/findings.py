"""Shared queries on findings: record one idempotently, change its status, list the open ones."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.errors import InvalidInput, NotFound
from store.models import Finding

SEVERITIES = ("low", "medium", "high")
STATUSES = ("open", "acknowledged", "resolved")


@dataclass
class FindingSpec:
    """One antipattern or waste in one workflow, with what proves it and what to do about it."""

    rule: str
    workflow_id: str
    source: str  # trace | telemetry
    severity: str
    title: str
    fix: str
    evidence: dict[str, Any] = field(default_factory=dict)
    location: str | None = None
    cost_s_per_step: float | None = None
    gpu_hours_per_day: float = 0.0
    trace_id: int | None = None
    device_id: int | None = None
    subject: str | None = None  # what makes it distinct within (rule, workflow): a rank, a device, a trace

    @property
    def fingerprint(self) -> str:
        return f"{self.rule}|{self.workflow_id}|{self.subject or ''}"


# what a spec sets on its row each time it is found
FINDING_FIELDS = ("rule", "workflow_id", "source", "severity", "title", "fix", "evidence", "location",
                  "cost_s_per_step", "gpu_hours_per_day", "trace_id", "device_id")


def upsert_finding(session: Session, spec: FindingSpec, now: float | None = None) -> Finding:
    """Record a finding; the same (rule, workflow, subject) found again updates the row instead of adding one.

    A resolved finding that is found again opens again; an acknowledged one stays acknowledged.
    """
    return upsert_findings(session, [spec], now)[0]


def upsert_findings(session: Session, specs: list[FindingSpec], now: float | None = None,
                    batch: int = 1000) -> list[Finding]:
    """upsert_finding for many specs at once: the rows already there are read in batches of `batch` fingerprints
    and everything is written in one flush (a fleet's detection finds thousands)."""
    for spec in specs:
        if spec.severity not in SEVERITIES:
            raise InvalidInput(f"severity {spec.severity!r} is not one of {SEVERITIES}")
    now = time.time() if now is None else now
    prints = list(dict.fromkeys(s.fingerprint for s in specs))
    known: dict[str, Finding] = {}
    for i in range(0, len(prints), batch):
        known.update((f.fingerprint, f) for f in session.scalars(
            select(Finding).where(Finding.fingerprint.in_(prints[i:i + batch]))))
    out = []
    for spec in specs:
        finding = known.get(spec.fingerprint)
        if finding is None:
            finding = known[spec.fingerprint] = Finding(fingerprint=spec.fingerprint, created_at=now, status="open")
            session.add(finding)
        elif finding.status == "resolved":
            finding.status = "open"
        for name in FINDING_FIELDS:
            setattr(finding, name, getattr(spec, name))
        finding.updated_at = now
        out.append(finding)
    session.flush()
    return out


def resolve_superseded(session: Session, workflow_id: str, subject: str, trace_id: int, found: set[str],
                       now: float | None = None) -> int:
    """Resolve the open trace findings of this workflow and subject (a rank) that an earlier trace found and this
    later one (`trace_id`, whose findings' fingerprints are `found`) did not: the job as profiled now no longer
    shows them. Findings of later traces are left alone, whatever order the traces are analysed in. Returns how many
    were resolved."""
    now = time.time() if now is None else now
    stale = session.scalars(select(Finding).where(
        Finding.source == "trace", Finding.workflow_id == workflow_id, Finding.status != "resolved",
        Finding.trace_id < trace_id))
    n = 0
    for finding in stale:
        if finding.fingerprint not in found and finding.fingerprint.rsplit("|", 1)[-1] == subject:
            finding.status, finding.updated_at = "resolved", now
            n += 1
    return n


def set_finding_status(session: Session, finding_id: int, status: str, by: str | None = None) -> Finding:
    if status not in STATUSES:
        raise InvalidInput(f"status {status!r} is not one of {STATUSES}")
    finding = session.get(Finding, finding_id)
    if finding is None:
        raise NotFound(f"no finding {finding_id} in the store")
    finding.status, finding.acted_by, finding.updated_at = status, by, time.time()
    session.flush()
    return finding


def open_findings(session: Session, *, workflow_id: str | None = None, rules: tuple[str, ...] = ()) -> list[Finding]:
    query = select(Finding).where(Finding.status != "resolved")
    if workflow_id is not None:
        query = query.where(Finding.workflow_id == workflow_id)
    if rules:
        query = query.where(Finding.rule.in_(rules))
    return list(session.scalars(query.order_by(Finding.gpu_hours_per_day.desc())))
