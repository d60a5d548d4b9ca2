"""Option groups of `shmbroker bench` kept beside the benchmarks they configure (`cli.py` adds them).

Declarations only: building the command line imports nothing heavy.
"""

from __future__ import annotations


def add_gen(p) -> None:
    """`bench gen`'s options (`--engine` is `bench embed`'s too)."""
    g = p.add_argument_group("gen")
    g.add_argument("--engine", choices=("vllm", "hf", "sim"), default=None,
                   help="gen: the engine on both sides (default vllm: .venv-vllm, `make vllm`); embed: hf (default) "
                        "or vllm (bench/embed_vllm.py, under .venv-vllm)")
    g.add_argument("--kv-blocks", type=int, default=None,
                   help="gen: the engine's KV cache in blocks of 32 tokens (default 256)")
    g.add_argument("--runs", type=int, default=2, help="gen: runs of each side, alternated (default 2)")
    g.add_argument("--sampling", action="store_true", help="gen: every item samples (temperature 0.7, top_p 0.95, "
                   "its own seed, a stop token, n = 2 on every fourth), the same requests on both sides")
    g.add_argument("--structured", action="store_true", help="gen: every item constrained by one of 4 JSON schemas")


def add_e2e_and_chaos(p) -> None:
    """`bench e2e`'s and `bench chaos`'s options."""
    g = p.add_argument_group("e2e")
    g.add_argument("--options", action="store_true",
                   help="e2e: every item carries one shared set of request options (e2e.SHARED_OPTIONS)")
    g.add_argument("--schema", action="store_true", help="e2e: every item references one shared JSON schema")
    g.add_argument("--embed", type=int, default=0, metavar="DIMS",
                   help="e2e: runs of embeddings alternated with the plain ones, each result a vector of DIMS float32 "
                        "values (embed_vs_plain)")
    g = p.add_argument_group("chaos")
    g.add_argument("--seconds", type=float, default=30.0,
                   help="chaos: how long processes and readers are killed at random (default 30)")
    g.add_argument("--fs-mib", type=int, default=None,
                   help="chaos: run the broker's data directory on a tmpfs of this many MiB that a filler keeps "
                        "filling (needs the right to mount)")


def add_embed(p) -> None:
    """`bench embed`'s options (it shares --scale, --seed and --engine with the others)."""
    g = p.add_argument_group("embed")
    g.add_argument("--threads", type=int, default=1,
                   help="embed: torch CPU threads of every side: the broker's engine, the fixed batches, "
                        "sentence-transformers (default 1)")


def add_scale(p) -> None:
    """`bench scale`'s options (it shares --scale and --seed)."""
    g = p.add_argument_group("scale")
    g.add_argument("--indexed", default="1000000", metavar="N[,N...]",
                   help="scale: the packing index alone at these sizes (items, comma-separated; 0: left out), "
                        "its bytes per item and decision times (default 1000000)")
