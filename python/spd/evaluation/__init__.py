"""Evaluation: per-dataset runs, the comparison grid, the cost model and the report."""
