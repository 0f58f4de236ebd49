"""The command-line shape every ``areal-env`` subcommand that reads an experiment shares:
``PROG CONFIG.yaml [options] [dotted.key=value ...]``, and one way to report a bad config
(the message on stderr, exit status 2)."""

from __future__ import annotations

import argparse
import sys

from areal_env.api.config import ConfigError, ExperimentConfig, load_config

OVERRIDES_HELP = "dotted overrides, e.g. rollout.n_samples=8"


def experiment_parser(
    prog: str, description: str, *, overrides_help: str = OVERRIDES_HELP
) -> argparse.ArgumentParser:
    """A parser with the ``config`` and ``overrides`` positionals (add options to it)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("config", help="YAML file with an ExperimentConfig")
    ap.add_argument("overrides", nargs="*", help=overrides_help)
    return ap


def load_experiment(prog: str, args: argparse.Namespace) -> ExperimentConfig | None:
    """``args.config`` with ``args.overrides`` applied; None after printing the error."""
    try:
        return load_config(ExperimentConfig, args.config, args.overrides)
    except ConfigError as e:
        fail(prog, str(e))
        return None


def fail(prog: str, message: str) -> int:
    """Print ``PROG: message`` on stderr; the exit status of a usage error (2)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2
