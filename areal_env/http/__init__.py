"""One HTTP toolkit for the package's three apps (proxy, ``areal-env serve``, service gateway).

- :mod:`~areal_env.http.net`: :func:`bind_socket` (TCP_NODELAY-safe), :func:`is_loopback`.
- :mod:`~areal_env.http.runner`: :class:`ServerThread` (uvicorn in a daemon thread),
  :func:`serve_forever` (foreground).
- :mod:`~areal_env.http.body`: :func:`read_json` (size limit), :func:`request_key`.
- :mod:`~areal_env.http.codec`: :func:`dumps`, :func:`loads`, :func:`json_response` (orjson).
- :mod:`~areal_env.http.errors`: :class:`HTTPError` and the one status -> type vocabulary
  (OpenAI and Anthropic shapes), :func:`install_error_handlers`.
- :mod:`~areal_env.http.routes`: every route path, shared by servers and clients.
- :mod:`~areal_env.http.client`: reading error bodies (httpx only, for light clients).
- :mod:`~areal_env.http.logs`: :func:`configure_console_logging` (the command lines' logging,
  HTTP libraries' per-request lines off).

Layer: beside ``api`` (the bottom); it imports nothing else from the package. This file
imports nothing, so a light client can use :mod:`~areal_env.http.routes` without loading the
server stack: import the submodules.
"""
