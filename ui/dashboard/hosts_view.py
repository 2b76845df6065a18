"""The hosts the enforcer leaves alone, named with why at the top of the pages that list hosts or plan moves (Fleet,
Enforcement); the rule is the store's (queries.hosts reads store.registry.hosts_left_alone)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ui.dashboard.common import Context, fresh


def host_table(ctx: Context) -> pd.DataFrame:
    """Every host with its status and why (queries.hosts), over this dashboard's silence limit; read afresh."""
    return fresh(ctx, "hosts", silence_s=ctx.settings.host_silence_s)


def left_alone_notice(hosts: pd.DataFrame) -> None:
    """A warning naming each host not heard from or taking no new job, with why; nothing when every host is ok."""
    left_alone = hosts[hosts.status != "ok"]
    if left_alone.empty:
        return
    st.warning(f"**Hosts the enforcer leaves alone ({len(left_alone)} of {len(hosts)})**: it moves no job onto "
               "them, nor off a host not heard from (the Fleet page's Hosts table gives every host's status).\n\n"
               + "\n".join(f"- **{r.host}** {r.why}" for r in left_alone.itertuples()), icon=":material/warning:")
