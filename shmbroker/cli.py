"""The `shmbroker` command: demo, bench, warm."""

from __future__ import annotations

import argparse
import json
import sys
import time

BENCHMARKS = ("ring", "backlog")


def _warm(args) -> int:
    """Compile every kernel into numba's on-disk cache and drop caches of older sources."""
    t0 = time.monotonic()
    import numpy as np

    from . import jit
    from .ring import digest, items, layout, spsc

    cap = 1024
    buf = np.zeros(layout.segment_bytes(cap), np.uint8)
    layout.init_header(buf, cap)
    tok = np.arange(4, dtype=np.uint32)
    items.push_item(buf, tok, 0, 1, items.NO_PREFIX, 0)
    offs = np.array([0, 4], np.int64)
    meta = np.zeros((1, layout.META_WORDS), np.uint32)
    spsc.push_many(buf, tok, offs, 1, meta, 0, 1)
    spsc.check_batch(offs, tok.size, 16)
    spsc.push(buf, tok, 2, 0, 0, 0, 0)
    out = np.empty(64, np.uint32)
    spsc.pop_many(buf, out, np.empty(3, np.int64), np.empty(2, np.uint64), np.empty((2, 4), np.uint32), 1)
    pos = np.empty(4, np.int64)
    n, tail, _ = spsc.peek_many(buf, pos, 4)
    acc = np.zeros(4, np.uint64)
    data = buf[layout.HEADER_BYTES :]
    digest.digest_records(data.view(np.uint32), data.view(np.uint64), pos, n, 1, acc)
    digest.digest_tokens(tok, acc)
    spsc.release(buf, tail, n)
    spsc.readable(buf)
    spsc.writable_words(buf)
    spsc.spin_until_readable(buf, 1)
    spsc.spin_until_writable(buf, 4, 1)
    spsc.set_waiting(buf, layout.H_CONSUMER_WAITING)
    spsc.clear_waiting(buf, layout.H_CONSUMER_WAITING)
    _warm_spill()
    removed = jit.prune_stale()
    print(f"numba kernels ready in {jit.CACHE_DIR} ({time.monotonic() - t0:.1f} s; {len(removed)} stale cache dirs removed)")
    return 0


def _warm_spill() -> None:
    """A tiny backlog round trip: append, recover (scan and index), gather, collect from a ring."""
    import tempfile

    import numpy as np

    from .ring import layout
    from .spill import collect, crc
    from .spill.layout import ITEM_DTYPE
    from .spill.store import Backlog

    with tempfile.TemporaryDirectory(prefix="shmb-warm-") as d:
        backlog, _ = Backlog.open(d, segment_bytes=8192)
        with backlog.writer(0, fsync="never") as writer:
            items = np.zeros(3, ITEM_DTYPE)
            writer.append_many(np.arange(1500, dtype=np.uint32), np.array([0, 500, 1000, 1500], np.int64), items)
        backlog.close()
        backlog, _ = Backlog.open(d, segment_bytes=8192)
        rows = backlog.pending()
        backlog.gather(rows, np.empty(1500, np.uint32), np.empty(rows.size + 1, np.int64))
        backlog.close()
    cap = 1024
    buf = np.zeros(layout.segment_bytes(cap), np.uint8)
    layout.init_header(buf, cap)
    data = buf[layout.HEADER_BYTES :]
    collect.collect(data.view(np.uint32), data.view(np.uint64), np.zeros(1, np.int64), 1, 1, 512,
                    np.empty(cap, np.uint32), np.empty(2, np.int64), np.zeros(1, ITEM_DTYPE))
    crc.crc32c(np.zeros(16, np.uint8))


def _demo(args) -> int:
    from . import demo

    demo.main(args.data_dir)
    return 0


def _bench(args) -> int:
    if args.name == "ring":
        from .bench import ring

        result = ring.run(scale=args.scale)
    elif args.name == "backlog":
        from .bench import backlog

        result = backlog.run(scale=args.scale)
    else:  # argparse's choices make this unreachable
        raise SystemExit(f"unknown benchmark {args.name!r}")
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value:,.3f}" if isinstance(value, float) else f"{key:>28}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmbroker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="two producers push a seeded workload through the rings into the backlog; prints throughput")
    p.add_argument("--data-dir", default=None, help="data directory (default $SHMBROKER_DATA_DIR or ./shmbroker-data)")
    p.set_defaults(func=_demo)
    p = sub.add_parser("bench", help="run a benchmark against its baseline in the same run")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--scale", type=float, default=1.0, help="workload size factor (default 1.0)")
    p.set_defaults(func=_bench)
    p = sub.add_parser("warm", help="compile the numba kernels into the on-disk cache")
    p.set_defaults(func=_warm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
