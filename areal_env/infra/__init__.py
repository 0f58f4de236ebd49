"""Integrations with external infrastructure (AEnvironment)."""
