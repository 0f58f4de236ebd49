"""The one set of content-to-text helpers: message content (a string, ``None``, or a list of
parts) as text, for every protocol, the renderer and the conversation cache.

Text parts are bare strings or objects of type ``text``, ``input_text``, ``output_text`` or
``refusal``. They are joined with nothing between them (:data:`PART_SEPARATOR`): in both the
OpenAI and the Anthropic APIs the parts of one message are spans of one text.
"""

from __future__ import annotations

from typing import Any

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})
PART_SEPARATOR = ""


class ContentError(ValueError):
    """Content that is not text; ``where`` names the offending request field."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def part_text(part: Any) -> str | None:
    """The text of one content part, or ``None`` when it is not a text part."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") in TEXT_PART_TYPES:
        text = part.get("text", part.get("refusal"))
        return text if isinstance(text, str) else None
    return None


def content_text(content: Any, where: str = "content", *, nested: bool = False) -> str:
    """Content as text; :class:`ContentError` for anything but text. ``nested``: a part may
    hold its own ``content`` (tool results), read recursively."""
    if isinstance(content, str):  # the common case first
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ContentError(f"'{where}' must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        text = part_text(part)
        if text is None and nested and isinstance(part, dict):
            inner = part.get("content")
            if isinstance(inner, str | list):
                text = content_text(inner, f"{where}[{j}].content", nested=True)
        if text is None:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ContentError(
                f"'{where}[{j}]': content part of type {kind!r} is not supported (text only)",
                where,
            )
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def content_summary(content: Any) -> str:
    """Content as text for matching and hashing, never failing: a non-text part counts as
    ``[its type]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return PART_SEPARATOR.join(
            text
            if (text := part_text(part)) is not None
            else f"[{part.get('type', 'part') if isinstance(part, dict) else 'part'}]"
            for part in content
        )
    return "" if content is None else str(content)
