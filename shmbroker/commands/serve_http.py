"""`shmbroker serve-http`: the OpenAI Files and Batches API alone, beside a running broker.

It serves the `[http]` table of the configuration on the broker's data directory, as the broker's
own `http` role would (`httpapi/server.py`): use one or the other on a data directory, not both.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys

from .common import print_error
from .jobrun import broker_description


def serve_http(args) -> int:
    from ..config import settings
    from ..config.settings import parse_addr
    from ..httpapi.server import open_api, run
    from ..observe.exporter import ExporterAddressError, addr_text, bind

    logging.basicConfig(level=logging.INFO, format="%(asctime)s shmbroker-http %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        cfg = settings.load(args.config, data_dir=args.data_dir)
    except settings.ConfigError as exc:
        print_error(str(exc))
        return 2
    if cfg.http is None:
        print_error(f"{cfg.source}: no [http] table: the API needs at least its keys ([http.keys])")
        return 2
    desc = broker_description(cfg.data_dir)
    if args.addr:
        cfg = dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, addr=args.addr))
    try:
        sock = bind(parse_addr(cfg.http.addr), "http.addr", 1024)
    except ExporterAddressError as exc:
        print_error(str(exc))
        return 2
    models = desc.get("models") or cfg.served_models()
    print(f"serving the OpenAI Files and Batches API on http://{addr_text(sock)}/v1 for {cfg.data_dir}",
          file=sys.stderr, flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    run(open_api(cfg.http, cfg.data_dir, models), sock, lambda: stop["now"])
    return 0
