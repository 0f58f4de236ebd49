"""``areal-env launch``: inference servers, then the torchrun trainer ranks (local or Slurm)."""
