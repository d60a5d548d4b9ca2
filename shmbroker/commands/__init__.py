"""`shmbroker submit`, `shmbroker results`, `shmbroker status`: the user-facing commands around a running broker.

Each runs in the user's own shell process, as a producer or a reader of the data directory.

    shmbroker submit prompts.jsonl [--trace] [--name N | --job J [--resume]] [--wait [--out F] [--idle-timeout S]]
    shmbroker jobs [--json]; shmbroker job J [--json | --watch]; shmbroker cancel J
    shmbroker results --name N [--out F] [--timeout S]
    shmbroker status [--json]
    shmbroker nats [--servers 1|3] [--dir D]
    shmbroker serve-http [--config F] [--addr HOST:PORT]

One module a command (`submit`, `results`, `status`, `local_nats`, `serve_http`, `jobs` for the three job commands); what they share is in `common`; how long `submit --wait` waits is `waiting`.

Exit status: 0 done; 1 some lines refused, a result missing, no broker; 2 a
bad configuration, file or option.
"""

from __future__ import annotations

from .jobs import cancel, job, jobs
from .local_nats import nats
from .results import results
from .serve_http import serve_http
from .status import status
from .submit import submit

__all__ = ["cancel", "job", "jobs", "nats", "results", "serve_http", "status", "submit"]
