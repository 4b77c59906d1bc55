"""Pipeline steps, each run as ``python -m tasks.<step>``. Never imports Airflow."""
