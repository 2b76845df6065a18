"""The Streamlit dashboard: the app and its pages, their charts and read-only queries, sign-in and actions."""
