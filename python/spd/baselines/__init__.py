"""Baselines SPD is compared with: the EAGLE-3-style head (PPSD is a PDM configuration)."""
