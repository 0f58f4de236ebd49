"""Wire protocols the proxy speaks: OpenAI chat, OpenAI Responses, Anthropic Messages.

Each module converts its requests to the internal OpenAI-chat form
(:class:`~areal_env.proxy.protocols.common.CompletionRequest`) and builds its own responses,
stream events and error bodies.
"""
