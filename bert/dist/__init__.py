"""Process-group setup, DDP wrapping and the gradient-clipping communication hooks."""
