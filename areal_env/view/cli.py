"""``areal-env view RUN_DIR | OUTPUTS_DIR``: the trajectory viewer in a browser.

    areal-env view outputs/demo/capitals          # one run
    areal-env view outputs                        # every run under it
    areal-env view outputs --host 0.0.0.0 --port 8765   # reachable from elsewhere: with a key

It reads the folder only (never writes), follows runs that are still training, and serves on
127.0.0.1 unless ``--host`` says otherwise; bound anywhere else it requires a key (``--key``,
``AREAL_ENV_VIEW_KEY``, or one generated and printed in the address to open).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import threading
import webbrowser
from pathlib import Path

from areal_env.http.net import bind_socket, is_loopback, url_host
from areal_env.http.runner import serve_forever
from areal_env.view.app import create_app
from areal_env.view.catalog import Catalog

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8765
KEY_ENV = "AREAL_ENV_VIEW_KEY"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="areal-env view",
        description="Browse a training run (or every run under a folder): metrics, each step's "
        "conversations as trees, their tokens shaded by what the update did, and the held-out "
        "evaluation before vs after. Read-only; follows runs that are still training.",
    )
    p.add_argument("path", help="a run folder (fileroot/experiment/trial) or a folder of runs")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any)"
    )
    p.add_argument(
        "--key",
        default=None,
        help=f"access key (default: ${KEY_ENV}; generated and printed when bound off loopback)",
    )
    p.add_argument("--open", action="store_true", help="open the page in a web browser")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(args.path).expanduser()
    if not root.exists():
        print(
            f"areal-env view: {str(root)!r} does not exist. Pass a run folder "
            "(fileroot/experiment/trial, e.g. outputs/demo/capitals) or the folder of runs "
            "(fileroot, e.g. outputs).",
            file=sys.stderr,
        )
        return 2
    if not root.is_dir():
        print(f"areal-env view: {str(root)!r} is a file, not a run folder", file=sys.stderr)
        return 2
    key = args.key or os.environ.get(KEY_ENV) or None
    generated = False
    if key is None and not is_loopback(args.host):
        key, generated = secrets.token_urlsafe(24), True
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(
            f"areal-env view: cannot listen on {args.host}:{args.port} ({e}); "
            "pick another --port (0 = any free one)",
            file=sys.stderr,
        )
        return 2
    port = sock.getsockname()[1]
    catalog = Catalog(root.resolve())
    app = create_app(catalog, key=key)
    url = f"http://{url_host(args.host)}:{port}/"
    if key is not None:
        url += f"?key={key}"
    runs = catalog.ids()
    threading.Thread(target=catalog.warm, name="view-index", daemon=True).start()

    def ready() -> None:
        what = "the run" if runs == ["."] else f"{len(runs)} run(s)" if runs else "no run yet"
        print(f"areal-env view: {what} under {root.resolve()}")
        print(f"open {url}" + ("   (key generated for this session)" if generated else ""))
        sys.stdout.flush()
        if args.open:
            webbrowser.open(url)

    serve_forever(app, sock, on_ready=ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
