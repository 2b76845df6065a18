"""The user's side of fleetlens: the Streamlit dashboard and the `fleetlens` command line."""
