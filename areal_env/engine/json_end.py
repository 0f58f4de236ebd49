"""Where a JSON value ends: a streaming bracket scanner for ``GenerationConfig.stop_at_json_end``.

Why: a reply under ``tool_choice: required`` is a call, and guided decoding (vLLM, SGLang, OpenAI)
ends it where the call's JSON ends. A weak model goes on writing after the closing bracket
(a made-up ``<tool_response>`` with a guessed result, "The answer is ..."); that text is sent
back to it as its own turn and misleads the next one. Strings and escapes are tracked, so
brackets inside argument values do not count.
"""

from __future__ import annotations


class JsonEnd:
    """Feed text; ``closed`` turns True once the brackets opened (in the prefix or the text fed
    after it) are closed back to ``depth`` (0: every one; 1: the first element of a list or
    object at the top, e.g. one call of a ``[{...}, {...}]`` call list)."""

    __slots__ = ("closed", "depth", "escape", "in_string", "opened", "rest", "stop_depth")

    def __init__(self, prefix: str = "", depth: int = 0) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.stop_depth = depth
        self.rest = ""
        """What the feed that closed the value held after the closing bracket (``,`` of a
        ``},`` token, say)."""
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.opened = False
        self.closed = False
        self.feed(prefix)

    def feed(self, text: str) -> bool:
        """Scan ``text``; True once the value is closed."""
        for i, ch in enumerate(text):
            if self.closed:
                self.rest = text[i:]
                break
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                self.opened = True
            elif ch in "]}":
                self.depth -= 1
                if self.opened and self.depth <= self.stop_depth:
                    self.closed = True
        return self.closed
