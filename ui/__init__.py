"""The user's side of fleetlens: the Streamlit dashboard, the `fleetlens` command line, and one host's loop."""
