"""Agent workflows: resolving ``workflow=...``, running episodes through the proxy, grouping,
and the rollout executor. (Nothing is imported here, so subprocess workers start without
loading torch.)"""
