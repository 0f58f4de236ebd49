"""areal-env-client: the agent side of the areal-env any-agent training service.

Depends on ``httpx`` only (``tqdm`` shows a progress bar when installed), so it installs next
to any agent stack without constraining it. The full ``areal-env`` package installs it too.
"""

from areal_env_client.hooks import SESSION_HEADER, SESSION_PATH, install_session_hook
from areal_env_client.retry import TRANSIENT_STATUS, RetryBudget, is_transient
from areal_env_client.runner import AgentFn, AgentResult, AgentRunner
from areal_env_client.session import (
    ENV_VARS,
    AgentServiceError,
    AgentSession,
    check_response,
    current_session,
    default_service_url,
    finalize,
    set_reward,
    strip_session_path,
)

__all__ = [
    "ENV_VARS",
    "SESSION_HEADER",
    "SESSION_PATH",
    "TRANSIENT_STATUS",
    "AgentFn",
    "AgentResult",
    "AgentRunner",
    "AgentServiceError",
    "AgentSession",
    "RetryBudget",
    "check_response",
    "current_session",
    "default_service_url",
    "finalize",
    "install_session_hook",
    "is_transient",
    "set_reward",
    "strip_session_path",
]
__version__ = "0.1.0"
