"""Start ``mcp-server-git`` (published by the MCP project) on the example repository.

    python examples/mcp/serve_git.py outputs/mcp-example/repo

Builds the repository first if it is missing (``build_repo.py``), then replaces this process
with ``mcp-server-git --repository REPO``, started inside REPO (so ``repo_path: "."`` works):
the agent talks to the real third-party server over stdio. ``McpConfig.command`` runs this script once per episode (``isolation: episode``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_repo import build  # noqa: E402


def main() -> None:
    repo = build(sys.argv[1] if len(sys.argv) > 1 else "outputs/mcp-example/repo")
    server = shutil.which("mcp-server-git") or str(Path(sys.executable).parent / "mcp-server-git")
    if not Path(server).exists():
        sys.exit("mcp-server-git is not installed: pip install mcp-server-git (in the dev extra)")
    # Inside the repository, repo_path "." is the repository: the easiest argument for a
    # small model to write (absolute paths work too).
    os.chdir(repo)
    os.execv(server, [server, "--repository", str(repo)])


if __name__ == "__main__":
    main()
