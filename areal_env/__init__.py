"""areal-env."""
