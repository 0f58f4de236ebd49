"""AEnvironment integration: config, the wire-protocol adapter, the control plane client and the
environment-server launcher."""
