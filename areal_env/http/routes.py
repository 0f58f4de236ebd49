"""Route paths shared by the servers that answer them and the clients that call them.

One spelling per path: a typo in a client is then an import error, not a 404 at run time.
"""

from __future__ import annotations

# ---- the interception proxy (areal_env.proxy): model routes, the wire protocols agents speak
CHAT_COMPLETIONS = "/v1/chat/completions"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
MODELS = "/v1/models"
HEALTH = "/health"
METRICS = "/metrics"

# ---- the proxy's RL control routes (admin key, or the session key for set_reward/end_session)
GRANT_CAPACITY = "/grant_capacity"
START_SESSION = "/rl/start_session"
SET_REWARD = "/rl/set_reward"
END_SESSION = "/rl/end_session"
EXPORT_TRAJECTORIES = "/export_trajectories"

# ---- the any-agent service gateway (areal_env.service)
SERVICE_SESSIONS = "/rl/v1/sessions"
SERVICE_SET_REWARD = "/rl/v1/set_reward"
SERVICE_FINALIZE = "/rl/v1/finalize"
SERVICE_SESSION = "/rl/v1/session"  # the session the request names (header, key or /s/{id})
SERVICE_SESSION_PREFIX = "/s/"  # /s/{session_id}/<any route>: the session named by the URL
SERVICE_KEYS = "/admin/keys"
SERVICE_STATUS = "/admin/status"

# ---- SGLang's native protocol (spoken by areal_env.engine.server and areal_env.engine.sglang)
GENERATE = "/generate"
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
GET_WEIGHT_VERSION = "/get_weight_version"
ABORT_REQUEST = "/abort_request"
FLUSH_CACHE = "/flush_cache"
HEALTH_GENERATE = "/health_generate"
GET_MODEL_INFO = "/get_model_info"
GET_SERVER_INFO = "/get_server_info"
LOAD_LORA_ADAPTER = "/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/unload_lora_adapter"

OPENAI_PREFIX = "/v1"


def is_anthropic_route(path: str) -> bool:
    """Routes whose clients (the anthropic SDK) expect Anthropic's error shape."""
    return path.startswith(MESSAGES)
