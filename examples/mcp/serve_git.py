"""Start ``mcp-server-git`` (published by the MCP project) on the example repository.

    python examples/mcp/serve_git.py outputs/mcp-example/example

Builds the repository first if it is missing (``build_repo.py``), then replaces this process
with ``mcp-server-git --repository REPO``, started in REPO's parent folder (so ``repo_path``
may be REPO's folder name): the agent talks to the real third-party server over stdio.
``McpConfig.command`` runs this script once per episode (``isolation: episode``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_repo import build  # noqa: E402


def main() -> None:
    repo = build(sys.argv[1] if len(sys.argv) > 1 else "outputs/mcp-example/example")
    server = shutil.which("mcp-server-git") or str(Path(sys.executable).parent / "mcp-server-git")
    if not Path(server).exists():
        sys.exit("mcp-server-git is not installed: pip install mcp-server-git (in the dev extra)")
    # Started in the repository's parent folder, repo_path "<folder name>" is the repository
    # (absolute paths work too). The example names it "example": the word the proxy's worked
    # tool-call example shows a small model, so its copied argument is right.
    os.chdir(repo.parent)
    os.execv(server, [server, "--repository", str(repo)])


if __name__ == "__main__":
    main()
