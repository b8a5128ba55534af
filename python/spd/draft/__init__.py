"""Drafting: the Pipeline Draft Module, its checkpoints, its CUDA-graph step, context lookup."""
