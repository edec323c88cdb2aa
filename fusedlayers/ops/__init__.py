"""torch.library registrations, one module per op (importing registers them)."""
