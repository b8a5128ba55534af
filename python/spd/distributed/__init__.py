"""The distributed runtime: n stage ranks and one draft rank on torch.distributed."""
