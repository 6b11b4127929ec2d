"""Version-guarded patches for frameworks that have no hook point."""
