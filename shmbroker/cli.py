"""shmbroker: a token-aware work broker for GPU LLM inference.

Run the broker (supervise), check its configuration (config), feed it (submit) and read what it made (results),
watch it (status, top), try it end to end on the simulated engine (demo), measure it against a baseline (bench), and
compile its kernels ahead (warm). Past one host: submit and results with --cluster use NATS JetStream; `nats` starts one."""

from __future__ import annotations

import argparse
import json
import sys
import time

BENCHMARKS = ("ring", "backlog", "pack", "e2e", "restart", "gpu", "gen", "chaos", "cluster", "jobs", "http", "faults", "embed", "scale")
GPUS_HELP = ("auto: one consumer per visible card (NVML, else the configuration's [[gpus]]) from its [[tiers]], "
             "in place of [[consumers]] (default: [[consumers]] as written)")


def _warm(args) -> int:
    """Compile every kernel into numba's on-disk cache and drop caches of older sources."""
    t0 = time.monotonic()
    from . import jit
    from .supervisor import warmup

    warmup.warm_all()
    removed = jit.prune_stale()
    print(f"numba kernels ready in {jit.CACHE_DIR} ({time.monotonic() - t0:.1f} s; {len(removed)} stale cache dirs removed)")
    return 0


def _demo(args) -> int:
    from .demo import run as demo

    demo.main(args.data_dir)
    return 0


def _bench(args) -> int:
    if args.name in ("ring", "backlog", "restart"):  # the workload's size is all they take
        import importlib

        result = importlib.import_module(f".bench.{args.name}", __package__).run(scale=args.scale)
    elif args.name == "pack":
        from .bench import pack

        result = pack.run(trace=args.trace, mode=args.mode, scale=args.scale, seed=args.seed,
                          max_new_tokens=1 if args.max_new_tokens is None else args.max_new_tokens,
                          max_wait_seconds=args.max_wait,
                          tolerance=args.padding_tolerance, workload=args.workload)
    elif args.name == "e2e":
        from .bench import e2e

        result = e2e.run(scale=args.scale, options=args.options, schema=args.schema, embed=args.embed)
    elif args.name == "gpu":
        from .bench import gpu
        from .errors import BrokerError

        try:
            result = gpu.run(scale=args.scale, trace=args.trace, seed=args.seed, device=args.device)
        except (BrokerError, ValueError) as exc:  # no engine packages, no GPU: say so, no traceback
            print(f"shmbroker: {exc}", file=sys.stderr)
            return 2
    elif args.name == "gen":
        from .bench import gen
        from .errors import BrokerError

        try:
            result = gen.run(engine=args.engine or "vllm", kv_blocks=args.kv_blocks, trace=args.trace, runs=args.runs,
                             max_new_tokens=args.max_new_tokens, sampling=args.sampling, structured=args.structured,
                             say=lambda line: print(line, file=sys.stderr))
        except (BrokerError, ValueError) as exc:  # no engine packages, no trace: say so, no traceback
            print(f"shmbroker: {exc}", file=sys.stderr)
            return 2
    elif args.name == "chaos":
        from .bench import chaos

        result = chaos.run(seconds=args.seconds, seed=args.seed, fs_mib=args.fs_mib)
    elif args.name == "cluster":
        from .bench import cluster

        result = cluster.run(trace=args.trace, scale=args.scale, seed=args.seed, key_blocks=args.key_blocks,
                             epsilon=args.epsilon, num_items=args.items or 20000, num_repeats=args.repeats or 3,
                             nodes=not args.no_nodes, say=lambda line: print(line, file=sys.stderr))
    elif args.name == "jobs":
        from .bench import jobs

        result = jobs.run(num_items=args.items or int(100_000 * args.scale), repeats=args.repeats or 3, seed=args.seed,
                          say=lambda line: print(line, file=sys.stderr))
    elif args.name == "http":
        from .bench import http

        result = http.run(lines=args.items or int(50_000 * args.scale), repeats=args.repeats or 4, seed=args.seed,
                          say=lambda line: print(line, file=sys.stderr))
    elif args.name == "embed":
        from .bench import embed

        result = embed.from_command(args)
        if result is None:  # no engine packages, no vLLM part: said on stderr, no traceback
            return 2
    elif args.name == "scale":
        from .bench import scale
        result = scale.from_command(args)
    elif args.name == "faults":
        from .bench import faults
        result = faults.run(items=args.items or int(240 * args.scale), say=lambda line: print(line, file=sys.stderr))
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
    """Validate a configuration file (or show the built-in default) and print it resolved; or print
    the configuration reference (docs/configuration.md) generated from the settings' fields."""
    if args.reference:
        from .config import reference

        sys.stdout.write(reference.markdown())
        return 0
    from .config import settings
    from .gpu.tiers import TierError, apply_gpus_auto

    try:
        cfg = settings.load(args.config)
        if args.gpus == "auto":
            cfg = apply_gpus_auto(cfg, say=lambda line: print(line, file=sys.stderr))
    except (settings.ConfigError, TierError) as exc:
        print(f"shmbroker: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(settings.as_dict(cfg), indent=2))
    return 0


def _load_config(args):
    from .config import settings

    return settings.load(getattr(args, "config", None), data_dir=getattr(args, "data_dir", None))


def _supervise(args) -> int:
    """Run the broker in the foreground until SIGTERM/SIGINT."""
    import logging

    from .config import settings
    from .disk.lockfile import AlreadyRunning
    from .gpu.tiers import TierError, apply_gpus_auto
    from .observe.exporter import ExporterAddressError
    from .supervisor.supervise import supervise

    logging.basicConfig(level=logging.INFO, format="%(asctime)s shmbroker %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        cfg = _load_config(args)
        if args.gpus == "auto":
            cfg = apply_gpus_auto(cfg)
        return supervise(cfg)
    except (settings.ConfigError, TierError) as exc:
        print(f"shmbroker: {exc}", file=sys.stderr)
        return 2
    except AlreadyRunning as exc:
        print(f"shmbroker: {exc}", file=sys.stderr)
        return 3
    except ExporterAddressError as exc:
        print(f"shmbroker: {exc}", file=sys.stderr)
        return 2


def _top(args) -> int:
    """A live view of a running broker until q, Ctrl-C or SIGTERM."""
    from .commands.common import config_data_dir, print_error
    from .observe import top

    if not 0 < args.interval <= top.INTERVAL_SECONDS_MAX:
        print_error(f"--interval must be more than 0 and at most {top.INTERVAL_SECONDS_MAX} seconds (got {args.interval})")
        return 2
    data_dir = config_data_dir(args)
    if data_dir is None:
        return 2
    return top.run(data_dir, args.interval)


def _commands(name: str):
    def run(args) -> int:
        from . import commands

        return getattr(commands, name)(args)

    return run


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(prog="shmbroker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_bench, _add_broker, _add_prompts, _add_jobs, _add_operations):
        add(sub)
    return parser


def _add_demo(sub) -> None:
    """`demo`: the broker on its built-in configuration, fed and checked."""
    p = sub.add_parser("demo", help="start the broker on its built-in configuration (two simulated consumers), feed it a seeded "
                       "generation workload from two producers, check every result, and race it against the "
                       "engines alone (every prompt in arrival order, continuous batching, LRU prefix caches)")
    p.add_argument("--data-dir", default=None, help="data directory (default $SHMBROKER_DATA_DIR or ./shmbroker-data)")
    p.set_defaults(func=_demo)


def _add_bench(sub) -> None:
    """`bench NAME`, with each benchmark's options in its own group."""
    from .workloads import FAMILIES  # light: names only

    p = sub.add_parser("bench", help="run a benchmark against its baseline in the same run")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--scale", type=float, default=1.0, help="workload size factor (default 1.0)")
    g = p.add_argument_group("pack")
    g.add_argument("--trace", default=None, help="Mooncake-format trace (JSONL) instead of the seeded generator")
    g.add_argument("--workload", choices=("generator",) + FAMILIES, default="generator",
                   help="pack: the seeded workload (default generator; the others: workloads/families.py, 8000 x scale items)")
    g.add_argument("--mode", choices=("offline", "streaming"), default="offline",
                   help="offline: the whole workload is the backlog; streaming: items arrive by timestamp")
    g.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="gpu: where the model runs (auto: a CUDA GPU when torch sees one)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="max_new_tokens of every item (default 1: prefill only); 0 keeps the workload's. "
                        "gen: the cap on each item's output length (default 4)")
    g.add_argument("--max-wait", type=float, default=None,
                   help="streaming: maximum wait in modeled seconds before aging (default: a quarter of the arrival span)")
    g.add_argument("--padding-tolerance", type=float, default=None,
                   help="padded engines: longest item <= (1 + tol) x shortest in a batch (default 1/16)")
    from .bench.options import add_e2e_and_chaos, add_embed, add_gen, add_scale  # light: declarations only
    from .cluster.options import NodeSettings  # light: declarations only (no nats, no kernels)

    add_gen(p)
    add_e2e_and_chaos(p)
    add_embed(p)
    add_scale(p)

    g = p.add_argument_group("cluster")
    g.add_argument("--key-blocks", type=int, default=None,
                   help="cluster: blocks past the family root in an item's partition key (default: the partitioner's, "
                        "DEFAULT_KEY_BLOCKS in cluster/partition.py)")
    g.add_argument("--epsilon", type=float, default=None,
                   help=f"cluster: no node above (1 + epsilon) x the mean of tokens (default {NodeSettings.epsilon})")
    g.add_argument("--items", type=int, default=None,
                   help="cluster: items published in the throughput run (default 20000); jobs: the job's items (default 100000 x scale); http: the batch file's lines (default 50000 x scale)")
    g.add_argument("--repeats", type=int, default=None,
                   help="cluster: throughput repeats of each side, interleaved (default 3); jobs: progress runs of each side (default 3); http: runs of each side (default 4)")
    g.add_argument("--no-nodes", action="store_true",
                   help="cluster: leave out the broker nodes' part (the fault run, items/s through one and two nodes)")
    p.set_defaults(func=_bench)


def _add_broker(sub) -> None:
    """`config` and `supervise`: check a configuration, run the broker on it."""
    p = sub.add_parser("config", help="check a configuration file and print it resolved (defaults filled in)")
    p.add_argument("--config", default=None, help="shmbroker.toml (default: the built-in configuration)")
    p.add_argument("--gpus", choices=("auto",), default=None, help=GPUS_HELP)
    p.add_argument("--reference", action="store_true",
                   help="print the reference of every key (markdown, docs/configuration.md) and exit")
    p.set_defaults(func=_config)
    p = sub.add_parser("supervise", help="run the broker: ingest, scheduler, results and one GPU process per consumer")
    p.add_argument("--config", default=None, help="shmbroker.toml (default: the built-in configuration)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--gpus", choices=("auto",), default=None, help=GPUS_HELP)
    p.set_defaults(func=_supervise)


def _add_prompts(sub) -> None:
    """`submit` and `results`: prompts in, results out."""
    p = sub.add_parser("submit", help="submit prompts from a JSONL file (or a Mooncake-format trace) to a running broker")
    p.add_argument("file", help="prompts, one JSON object a line: {\"tokens\": [...], \"max_new_tokens\": N, ...}")
    p.add_argument("--trace", action="store_true", help="FILE is a Mooncake-format trace (tokens synthesised from its hash ids)")
    p.add_argument("--name", default=None, help="producer name (default: submit-<pid>); `results` reads under the same name")
    p.add_argument("--config", default=None, help="shmbroker.toml (for its data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default max_new_tokens of lines that give none")
    p.add_argument("--wait", action="store_true", help="also wait for every result and write them (see --out)")
    p.add_argument("--out", default=None, help="with --wait: results JSONL file (default: standard output)")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="S", help="with --wait: give up after S s without "
                   "a result (default: wait while a consumer of the items' model runs, starts or restarts; --cluster: 60)")
    p.add_argument("--cluster", default=None, metavar="nats://HOST:PORT[,...]",
                   help="publish to a cluster's prompts stream on these NATS servers instead of a local broker")
    g = p.add_argument_group("jobs")
    g.add_argument("--job", nargs="?", const="", default=None, metavar="NAME",
                   help="submit FILE as a batch job (also its producer name; a name is made up when none is given)")
    g.add_argument("--resume", action="store_true",
                   help="take up job NAME again on the same file: submit only what has no result yet")
    g.add_argument("--out-format", choices=("native", "openai"), default="native",
                   help="with --wait: results as this format's lines (openai: the OpenAI Batch output format)")
    g.add_argument("--error-file", default=None,
                   help="--out-format openai: where failed items go (default: OUT with .errors before its extension)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json (or a directory holding one): text and chat prompts become token ids, results get "
                        "text (default: the model's entry in the broker's [tokenizers] table)")
    g.add_argument("--progress-seconds", type=float, default=None, metavar="S",
                   help="without a terminal: seconds between two progress lines (default 5)")
    g.add_argument("--model", default=None,
                   help="every item's model, in place of what the lines say (default: the broker's default model, "
                        "that of consumers declaring none)")
    p.set_defaults(func=_commands("submit"))
    p = sub.add_parser("results", help="write the results a producer name has not read yet as JSONL")
    p.add_argument("--name", required=True, help="the producer name the prompts were submitted under")
    p.add_argument("--out", default=None, help="JSONL file (default: standard output)")
    p.add_argument("--timeout", type=float, default=2.0, help="stop once no result came for this many seconds")
    p.add_argument("--config", default=None, help="shmbroker.toml (for its data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--cluster", default=None, metavar="nats://HOST:PORT[,...]",
                   help="read the producer's results subject on these NATS servers instead of a local broker")
    p.add_argument("--out-format", choices=("native", "openai"), default="native",
                   help="a job's results as this format's lines (openai: the OpenAI Batch output format, keyed by custom_id)")
    p.add_argument("--error-file", default=None,
                   help="--out-format openai: where failed items go (default: OUT with .errors before its extension)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="a job's results: generated ids as text too "
                                                                         "(default: the broker's [tokenizers] table)")
    p.set_defaults(func=_commands("results"))


def _add_jobs(sub) -> None:
    """`jobs`, `job` and `cancel`: the batch jobs of a data directory."""
    p = sub.add_parser("jobs", help="list the batch jobs of a data directory")
    p.add_argument("--config", default=None, help="shmbroker.toml (for its data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--json", action="store_true",
                   help="a JSON list of objects (name, status, total, completed, failed, cancelled, ...)")
    p.set_defaults(func=_commands("jobs"))
    p = sub.add_parser("job", help="show one batch job (--watch: its progress until it ends)")
    p.add_argument("name")
    p.add_argument("--config", default=None, help="shmbroker.toml (for its data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--watch", action="store_true", help="show its progress until it is completed, cancelled or failed")
    p.add_argument("--progress-seconds", type=float, default=None, metavar="S",
                   help="--watch without a terminal: seconds between two progress lines (default 5)")
    p.set_defaults(func=_commands("job"))
    p = sub.add_parser("cancel", help="cancel a batch job: items not yet dispatched come back cancelled, those in flight finish")
    p.add_argument("name")
    p.add_argument("--config", default=None, help="shmbroker.toml (for its data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.set_defaults(func=_commands("cancel"))


def _add_operations(sub) -> None:
    """`nats`, `status`, `top`, `serve-http` and `warm`: a local NATS server, a running broker watched, its
    HTTP API alone, the kernels compiled."""
    p = sub.add_parser("nats", help="start a local NATS server (or a cluster) with JetStream in the foreground and print its URLs")
    p.add_argument("--servers", type=int, choices=(1, 3), default=1, help="1 server, or a cluster of 3 (default 1)")
    p.add_argument("--dir", default=None, help="where the servers keep their stores and logs (default: a temporary directory)")
    p.set_defaults(func=_commands("nats"))
    p = sub.add_parser("status", help="one screen about a running broker: backlog, consumers, rates")
    p.add_argument("--config", default=None, help="shmbroker.toml (for its data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the screen")
    p.set_defaults(func=_commands("status"))
    p = sub.add_parser("top", help="a live view of a running broker (read-only; q or Ctrl-C quits)")
    p.add_argument("--config", default=None, help="shmbroker.toml (for its data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes, at most 0.5 (default 0.5)")
    p.set_defaults(func=_top)
    p = sub.add_parser("serve-http", help="serve the OpenAI Files and Batches API ([http]) beside a running broker")
    p.add_argument("--config", default=None, help="shmbroker.toml (its [http] table and data_dir)")
    p.add_argument("--data-dir", default=None, help="data directory (overrides the configuration's)")
    p.add_argument("--addr", default=None, help="host:port (overrides http.addr)")
    p.set_defaults(func=_commands("serve_http"))
    p = sub.add_parser("warm", help="compile the numba kernels into the on-disk cache (make demo and make test do)")
    p.set_defaults(func=_warm)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
