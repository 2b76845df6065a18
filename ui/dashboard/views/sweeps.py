"""Sweeps page: each hyper-parameter sweep sized by Fluid: every trial's width over time, its starts, resizes and
hold-backs (with their reasons), and the sweep's GPU use against what one trial per GPU would have used."""

from __future__ import annotations

import streamlit as st

from store.errors import FleetlensError
from ui.dashboard import charts
from ui.dashboard.common import ago, context, fresh, report

ctx = context()
st.title("Sweeps")

try:
    sweeps = fresh(ctx, "sweeps")
    labelled = fresh(ctx, "sweep_trials")
except FleetlensError as exc:
    report(exc)
    st.stop()

if not labelled.empty:
    with st.expander(f"Trials of other tuners ({labelled.sweep.nunique()} sweeps, FLEETLENS_SWEEP)"):
        st.dataframe(labelled, hide_index=True)

if sweeps.empty:
    st.info("No sweep recorded yet. A Ray Tune sweep run with fleetlens's Fluid scheduler (`collector.tune`, the "
            "`tune` extra) records every trial's start, resize and end here.", icon=":material/tune:")
    st.stop()

sweep_id = st.selectbox("Sweep", list(sweeps.id), key="fl_sweep")
sweep = sweeps[sweeps.id == sweep_id].iloc[0]
settings = dict(sweep.settings or {})
events, use = fresh(ctx, "sweep_events", sweep_id, int(sweep.gpus))
st.caption(f"{sweep.engine} · {int(sweep.gpus)} GPUs · " + " · ".join(f"{k} {v}" for k, v in settings.items())
           + f" · started {ago(sweep.created_at)}")

trials = events.trial_id.nunique()
resizes = int((events.kind == "resize").sum())
span = float(use.t.max() - use.t.min()) if len(use) > 1 else 0.0
held = float(((use.t.shift(-1) - use.t).fillna(0) * use.held).sum())
one = float(((use.t.shift(-1) - use.t).fillna(0) * use.one_per_gpu).sum())
m = st.columns(4)
m[0].metric("Trials", trials)
m[1].metric("Resizes", resizes)
m[2].metric("GPU-seconds held", f"{held:,.0f}")
m[3].metric("One trial per GPU", f"{one:,.0f}")
if events.empty:
    st.caption("No trial has reported yet.")
    st.stop()
st.plotly_chart(charts.sweep_widths(events))
st.plotly_chart(charts.sweep_gpu_use(use, int(sweep.gpus)))

st.subheader("Rounds")
st.caption("Each trial's starts, resizes (restarted from its checkpoint at the new width), hold-backs with the "
           "reason, and its end, in the order the scheduler made them.")
rounds = events.groupby("trial_id", sort=False).agg(
    starts=("kind", lambda k: int((k == "start").sum())), resizes=("kind", lambda k: int((k == "resize").sum())),
    widest=("new_width", "max"), ended=("kind", lambda k: "died" if (k == "died").any()
                                         else "finished" if (k == "finish").any() else "running"))
st.dataframe(rounds)
st.dataframe(events[["seq", "trial_id", "kind", "old_width", "new_width", "steps_left", "reason"]],
             hide_index=True)
if span:
    st.caption(f"Over {span:,.0f} s.")
