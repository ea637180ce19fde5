"""Benchmarks: each compares two things in one run and prints a table, then one JSON line."""
