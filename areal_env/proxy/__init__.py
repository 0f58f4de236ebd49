"""The interception proxy: OpenAI/Anthropic-compatible endpoints with token-exact capture.

Submodules (import them directly; this package stays import-light on purpose so that light
clients can import ``areal_env.proxy.client`` without pulling torch or transformers):

- ``render``: chat-template rendering and token-exact multi-turn prompt splicing.
- ``tool_parsers``: per-model-family tool-call parsers and tool prompt formats.
- ``cache``: the per-session conversation tree, rewards, discounting and export.
"""
