"""The Streamlit dashboard's entry point: page setup, store and sign-in in the sidebar, and the page navigation.

Run it with `fleetlens ui` (which calls `streamlit run` on this file with the configured store).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

HERE = Path(__file__).resolve().parent

st.set_page_config(page_title="fleetlens", page_icon=":material/monitoring:", layout="wide")

pages = st.navigation(
    [
        st.Page(HERE / "views" / "fleet.py", title="Fleet", icon=":material/dns:",
                url_path="fleet", default=True),
        st.Page(HERE / "views" / "workflow.py", title="Workflow", icon=":material/model_training:",
                url_path="workflow"),
        st.Page(HERE / "views" / "findings.py", title="Findings", icon=":material/troubleshoot:",
                url_path="findings"),
        st.Page(HERE / "views" / "enforcement.py", title="Enforcement", icon=":material/swap_horiz:",
                url_path="enforcement"),
        st.Page(HERE / "views" / "sweeps.py", title="Sweeps", icon=":material/tune:", url_path="sweeps"),
        st.Page(HERE / "views" / "serving.py", title="Serving", icon=":material/speed:", url_path="serving"),
    ]
)
pages.run()
