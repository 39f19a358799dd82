"""Data plane: torch.distributed groups built directly on store prefixes, the `Comm` handles user
code calls, the per-step commit vote, and raw-tensor state transfer."""
