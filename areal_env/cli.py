"""`areal-env` command line: each subcommand lives in the module that owns it (imported lazily)."""

from __future__ import annotations

import importlib
import sys

from areal_env.http.logs import configure_console_logging

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "areal_env.trainer.cli",
        "Train: areal-env train CONFIG.yaml [section.key=value ...]",
    ),
    "launch": (
        "areal_env.launch.local",
        "Start inference servers, then torchrun trainer ranks: areal-env launch CONFIG.yaml",
    ),
    "eval": (
        "areal_env.trainer.eval_cli",
        "Evaluate a checkpoint (or the base model) on held-out data: areal-env eval CONFIG.yaml",
    ),
    "demo": ("areal_env.demo", "The main job: a short training run on the embedded default model"),
    "serve": (
        "areal_env.engine.server",
        "Serve a model over SGLang's HTTP protocol (+ OpenAI API)",
    ),
    "proxy": ("areal_env.proxy.server", "Run the interception proxy on an embedded engine"),
    "serve-training": ("areal_env.service.server", "Any-agent training service"),
    "view": (
        "areal_env.view.cli",
        "Browse runs in a web browser: areal-env view RUN_DIR | OUTPUTS_DIR",
    ),
}


def _usage() -> str:
    lines = ["usage: areal-env COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<16}{help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\nRun `areal-env COMMAND --help` for a command's options.")
    return "\n".join(lines)


def module_for(name: str, rest: list[str]) -> str:
    """The module that owns ``areal-env NAME``: ``serve`` with ``--experiment``/``--checkpoint``
    serves a trained checkpoint through the OpenAI/Anthropic API (a service-layer command)."""
    if name == "serve" and any(a.split("=")[0] in ("--experiment", "--checkpoint") for a in rest):
        return "areal_env.service.inference"
    return SUBCOMMANDS[name][0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"areal-env: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    configure_console_logging()
    module = importlib.import_module(module_for(name, rest))
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
