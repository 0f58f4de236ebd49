"""``areal-env view``: the trajectory viewer (a local, read-only web app over run folders).

- :mod:`~areal_env.view.cli`: the command.
- :mod:`~areal_env.view.app`: the JSON API and the page (``static/``).
- :mod:`~areal_env.view.catalog`: the runs under a folder; :mod:`~areal_env.view.run`: one run's
  files, indexed and followed while it trains.
- :mod:`~areal_env.view.tree`: a session's dump lines as a conversation tree;
  :mod:`~areal_env.view.tokens`: the token records; :mod:`~areal_env.view.evals`: held-out
  evaluations before vs after.
- :mod:`~areal_env.view.jsonl`: following a JSONL file another process appends to.

Layer: beside ``service`` and ``launch`` (it reads what ``trainer`` writes).
"""
