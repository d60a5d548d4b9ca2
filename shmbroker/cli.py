"""The `shmbroker` command: demo, bench, warm."""

from __future__ import annotations

import argparse
import json
import sys
import time

BENCHMARKS = ("ring", "backlog", "pack")


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
    _warm_pack()
    removed = jit.prune_stale()
    print(f"numba kernels ready in {jit.CACHE_DIR} ({time.monotonic() - t0:.1f} s; {len(removed)} stale cache dirs removed)")
    return 0


def _warm_pack() -> None:
    """Both policies on a tiny workload (aging on and off), the guard, the trace synthesis."""
    import numpy as np

    from .bench import trace
    from .pack.contract import Contract, Shape
    from .pack.guard import Guard
    from .pack.packer import ConsumerSpec, Packer
    from .pack.shapes import shape_items

    tokens = np.arange(2000, dtype=np.uint32)
    shapes = shape_items(tokens, np.array([0, 600, 1300, 2000], np.int64), np.array([0, 100, 0], np.int64))
    for mode in ("padded", "packed"):
        for wait in (None, 1.0):
            packer = Packer([ConsumerSpec("a", Contract(4, 4096, 1024), mode),
                             ConsumerSpec("b", Contract(2, 1024, 512), mode)], capacity=8, max_wait_seconds=wait)
            for i in range(len(shapes)):
                packer.add(i, 0.0, int(shapes.lengths[i]), 1, 0, int(shapes.families[i]), shapes.blocks(i))
            while packer.next_batch(0, 5.0) is not None or packer.next_batch(1, 5.0) is not None:
                pass
            packer.add_many(np.arange(len(shapes), dtype=np.uint64), 0.0, shapes, 1)
    Guard(0.1).check(shapes.families, shapes.models, shapes.lengths, Shape(0, int(shapes.families[0]), 1, 700),
                     Contract(4, 4096, 1024))
    out = np.empty(600, np.uint32)
    trace.synthesise(np.array([1, 2], np.int64), np.array([0, 2], np.int64), np.array([600], np.int64), 512, 100,
                     out, np.array([0, 600], np.int64))


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
    elif args.name == "pack":
        from .bench import pack

        result = pack.run(trace=args.trace, mode=args.mode, scale=args.scale, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, max_wait_seconds=args.max_wait,
                          tolerance=args.padding_tolerance)
    else:  # argparse's choices make this unreachable
        raise SystemExit(f"unknown benchmark {args.name!r}")
    if args.json:
        print(json.dumps(result))
    else:
        _print_figures(result, "")
    return 0


def _print_figures(result: dict, indent: str) -> None:
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print_figures(value, indent + "  ")
        else:
            print(f"{indent}{key:>30}: {value:.6g}" if isinstance(value, float) else f"{indent}{key:>30}: {value}")


def _config(args) -> int:
    """Validate a configuration file (or show the built-in default) and print it resolved."""
    from . import settings

    try:
        cfg = settings.load(args.config)
    except settings.ConfigError as exc:
        print(f"shmbroker: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(settings.as_dict(cfg), indent=2))
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
    g = p.add_argument_group("pack")
    g.add_argument("--trace", default=None, help="Mooncake-format trace (JSONL) instead of the seeded generator")
    g.add_argument("--mode", choices=("offline", "streaming"), default="offline",
                   help="offline: the whole workload is the backlog; streaming: items arrive by timestamp")
    g.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    g.add_argument("--max-new-tokens", type=int, default=1,
                   help="max_new_tokens of every item (default 1: prefill only); 0 keeps the workload's")
    g.add_argument("--max-wait", type=float, default=None,
                   help="streaming: maximum wait in modeled seconds before aging (default: a quarter of the arrival span)")
    g.add_argument("--padding-tolerance", type=float, default=None,
                   help="padded engines: longest item <= (1 + tol) x shortest in a batch (default 1/16)")
    p.set_defaults(func=_bench)
    p = sub.add_parser("config", help="check a configuration file and print it resolved (defaults filled in)")
    p.add_argument("--config", default=None, help="shmbroker.toml (default: the built-in configuration)")
    p.set_defaults(func=_config)
    p = sub.add_parser("warm", help="compile the numba kernels into the on-disk cache")
    p.set_defaults(func=_warm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
