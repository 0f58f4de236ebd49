"""The any-agent training service: external agents train a model over the network.

Server side: ``gateway`` (public endpoint, auth, routing), ``source`` (trajectories → batches),
``server`` (``areal-env serve-training``), ``inference`` (serving a trained checkpoint).
Client side (light, no torch): ``client`` (``AgentSession``, ``AgentRunner``).
Nothing is imported here so that ``areal_env.service.client`` stays light.
"""
