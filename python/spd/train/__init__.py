"""PDM training: distillation data and the feature cache, the training layout, the loop."""
