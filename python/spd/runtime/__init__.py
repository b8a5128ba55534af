"""Decoding one sequence: the shared types, the pipeline schedule, the sequence decode, the engine."""
