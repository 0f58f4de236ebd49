"""Build the example's git repository: six commits by three authors, the same every time.

    python examples/mcp/build_repo.py outputs/mcp-example/example

The questions in ``dataset.jsonl`` are about this history (who wrote which commit, how many
commits there are, ...); the agent answers them through ``mcp-server-git``'s tools.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

ADA = "Ada Lovelace <ada@example.com>"
ALAN = "Alan Turing <alan@example.com>"
GRACE = "Grace Hopper <grace@example.com>"

# (author, message, {file: content}) in commit order
HISTORY = [
    (ADA, "Initial commit: add README", {"README.md": "# tinyparse\nA tiny parser.\n"}),
    (ALAN, "Add parser module", {"parser.py": "def parse(text):\n    return text.split()\n"}),
    (
        GRACE,
        "Add tests for the parser",
        {"test_parser.py": "from parser import parse\n\nassert parse('a b') == ['a', 'b']\n"},
    ),
    (ADA, "Fix typo in README", {"README.md": "# tinyparse\nA tiny text parser.\n"}),
    (
        GRACE,
        "Add command-line interface",
        {"cli.py": "import sys\nfrom parser import parse\n\nprint(parse(sys.argv[1]))\n"},
    ),
    (ALAN, "Speed up tokenizer", {"parser.py": "def parse(text):\n    return text.split(None)\n"}),
]


def _git(repo: Path, *args: str, who: str | None = None, when: int = 0) -> None:
    env = dict(os.environ)
    if who:
        name, email = who[:-1].split(" <")
        date = f"2026-01-0{1 + when}T10:00:00+00:00"
        env.update(
            GIT_AUTHOR_NAME=name,
            GIT_AUTHOR_EMAIL=email,
            GIT_COMMITTER_NAME=name,
            GIT_COMMITTER_EMAIL=email,
            GIT_AUTHOR_DATE=date,
            GIT_COMMITTER_DATE=date,
        )
    subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)


def build(repo: str | os.PathLike) -> Path:
    """Create the repository at ``repo`` unless it is already complete; returns its path."""
    repo = Path(repo).resolve()
    repo.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(repo) + ".lock"):
        done = repo / ".git" / "areal-example-complete"
        if done.exists():
            return repo
        if repo.exists():
            import shutil

            shutil.rmtree(repo)  # a half-built repository from an interrupted run
        repo.mkdir()
        _git(repo, "init", "-q", "-b", "main")
        for i, (who, message, files) in enumerate(HISTORY):
            for name, content in files.items():
                (repo / name).write_text(content)
            _git(repo, "add", *files)
            _git(repo, "commit", "-q", "-m", message, who=who, when=i)
        done.touch()
    return repo


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "outputs/mcp-example/example"))
