"""Analyses: pure functions from tables (pandas DataFrames) to tables. No I/O, no globals."""
