"""Model construction and loading (tiny offline models, local checkpoints)."""
