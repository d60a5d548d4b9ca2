"""`shmbroker nats`: a local NATS server or cluster with JetStream, in the foreground, for trying the cluster.

    shmbroker nats [--servers 1|3] [--dir D]

Prints the client URLs (one a line on stdout, for scripts), then runs until Ctrl-C or SIGTERM
and stops every server it started. Loopback only; with --dir the JetStream stores stay there
between runs (else a temporary directory, removed at exit).
"""

from __future__ import annotations

import signal
import threading

from .common import print_error

WATCH_SECONDS = 0.5


def nats(args) -> int:
    from ..cluster.servers import NatsServers
    from ..errors import ConfigError

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            servers = NatsServers.start(args.servers, args.dir)
        except (ConfigError, ValueError, OSError, RuntimeError, TimeoutError) as exc:
            print_error(str(exc))
            return 2 if isinstance(exc, (ConfigError, ValueError)) else 1
        with servers:
            for url in servers.urls:
                print(url, flush=True)
            kind = "server" if servers.num_servers == 1 else f"cluster of {servers.num_servers} servers"
            print_error(f"NATS {kind} with JetStream on {','.join(servers.urls)} (stores in {servers.base_dir}); "
                 f"Ctrl-C stops it. Submit with: shmbroker submit FILE --cluster {servers.urls[0]}")
            while not stop.wait(WATCH_SECONDS):
                dead = [i for i in range(servers.num_servers) if not servers.alive(i)]
                if dead:
                    print_error(f"nats-server n{dead[0]} exited (its log: {servers.base_dir}/n{dead[0]}/nats-server.log); stopping")
                    return 1
        print_error("stopped")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
