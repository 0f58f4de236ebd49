"""Wire protocols the proxy speaks: OpenAI chat, OpenAI Responses, Anthropic Messages.

Each module converts its requests to the internal OpenAI-chat form
(:class:`~areal_env.proxy.protocols.common.CompletionRequest`) and holds one
:class:`~areal_env.proxy.protocols.common.WireProtocol` object (``OpenAIChat``,
``OpenAIResponses``, ``AnthropicMessages``) that builds its responses, stream events and error
bodies; ``proxy/app.py`` holds only the shared pipeline and the routes.
"""
