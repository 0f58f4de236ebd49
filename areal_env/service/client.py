"""The agent-side client, re-exported from the light ``areal-env-client`` distribution.

``client/`` in this repository is its own small package (``areal_env_client``, httpx only), so
an agent's machine installs it without torch or the trainer's pinned SDKs; the full package
ships the same module and re-exports it here. Importing this module pulls in nothing of the
training stack.
"""

from __future__ import annotations

try:
    import areal_env_client as _client
except ImportError:  # a source checkout run with PYTHONPATH=<repo>: use its client/ folder
    import sys
    from pathlib import Path

    _folder = Path(__file__).resolve().parents[2] / "client"
    if not (_folder / "areal_env_client").is_dir():
        raise
    sys.path.append(str(_folder))
    import areal_env_client as _client

from areal_env_client import *  # noqa: E402,F403
from areal_env_client import __all__ as __all__  # noqa: E402
from areal_env_client.hooks import _ACTIVE  # noqa: E402,F401 - for tests of the hook
from areal_env_client.session import _CURRENT  # noqa: E402,F401

__version__ = _client.__version__
