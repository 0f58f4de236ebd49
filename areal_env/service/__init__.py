"""The any-agent training service: external agents train a model over the network.

Server side: ``gateway`` (public endpoint, auth, routing), ``source`` (trajectories → batches),
``server`` (``areal-env serve-training``), ``inference`` (serving a trained checkpoint).
Client side (light, no torch): the ``areal_env_client`` package (``AgentSession``,
``AgentRunner``), shipped in ``client/``. Nothing is imported here.
"""
