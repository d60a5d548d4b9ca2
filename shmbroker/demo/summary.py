"""The demo's summary: one sentence saying what was run and what was measured, the table (the
broker's consumers from its counters, their total, the engine alone and FIFO beside), one line per
producer, and how the broker stopped.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
NOT_COUNTED = "-"  # a consumer's tokens out: the GPU processes count input tokens only


def _count(n: int) -> str:
    return NUMBERS[n] if 0 <= n < len(NUMBERS) else f"{n:,}"


def _millions(n: int) -> str:
    return f"{n / 1e6:,.1f} M"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _is_total(f: dict) -> bool:
    """A column of all the broker's consumers together (a consumer's own figures have no makespan)."""
    return "makespan_seconds" in f


def headline(report: dict) -> str:
    """The first sentence: what was run, what was measured, and the ratio of the two makespans."""
    gpus = len(report["consumers"])
    generated = "generated" if report["max_new_tokens"] is None else f"max_new_tokens={report['max_new_tokens']}"
    return (f"Ran {report['items']:,} {generated} prompts ({_millions(report['input_tokens'])} tokens in, "
            f"{_millions(report['output_tokens'])} tokens out) through a live broker with {_count(gpus)} simulated "
            f"GPU{'s' if gpus != 1 else ''}, and the same prompts through the engines alone (arrival order, "
            f"continuous batching, LRU prefix caches): modeled makespan "
            f"{report['total']['makespan_seconds']:,.1f} s vs {report['engine_alone']['makespan_seconds']:,.1f} s "
            f"({report['vs_engine_alone']['makespan_ratio']:.3f}).")


def verdict(report: dict) -> str:
    """The line under the headline: the mark, and FIFO batch-at-a-time second."""
    v, fifo = report["vs_engine_alone"], report["fifo"]
    mark = "met" if v["met"] else "NOT met"
    return (f"The broker's modeled makespan is {v['makespan_ratio']:.3f} of the engine alone's (mark: at most "
            f"{v['makespan_ratio_max']:.2f}, {mark}); FIFO batch-at-a-time on the same engines: "
            f"{fifo['makespan_seconds']:,.1f} s (the broker's {1 / report['vs_fifo']['makespan_speedup']:.3f} of it).")


class Row(NamedTuple):
    """One row of the table: a label, how a broker column reads it, how a simulated one does."""

    label: str
    broker: Callable[[dict], str]
    simulated: Callable[[dict], str]


def _rows(report: dict) -> list[Row]:
    hit_max = _pct(report["engine_alone"]["cache_hit_rate_max"])
    return [
        Row("batches (groups)", lambda f: f"{f['batches']:,}", lambda f: f"{f['batches']:,}"),
        Row("items", lambda f: f"{f['items']:,}", lambda f: f"{f['items']:,}"),
        Row("tokens in", lambda f: _millions(f["tokens"]), lambda f: _millions(f["input_tokens"])),
        Row("tokens out", lambda f: _millions(f["output_tokens"]) if _is_total(f) else NOT_COUNTED,
            lambda f: _millions(f["output_tokens"])),
        Row("cache hit rate", lambda f: _pct(f["cache_hit_rate"]), lambda f: _pct(f["cache_hit_rate"])),
        Row("  each block once", lambda f: hit_max if _is_total(f) else "", lambda f: hit_max),
        Row("families", lambda f: f"{f['families']:,}", lambda f: f"{f['families_served']:,}"),
        Row("engine seconds", lambda f: f"{f['modeled_seconds']:,.1f}", lambda f: f"{f['modeled_seconds']:,.1f}"),
        Row("[bold]makespan[/]", lambda f: f"[bold]{f['makespan_seconds']:,.1f}[/]" if _is_total(f) else "",
            lambda f: f"[bold]{f['makespan_seconds']:,.1f}[/]"),
        Row("idle (wall s)", lambda f: f"{f['idle_wall_seconds']:,.1f}", lambda f: ""),
        Row("failed, refused", lambda f: f"{f['failed']}, {f['guard_violations']}", lambda f: ""),
    ]


def _table(report: dict):
    from rich import box
    from rich.table import Table

    names = list(report["consumers"])
    t = Table(title="modeled seconds: the broker's from its counters, the others simulated", title_justify="left",
              box=box.SIMPLE_HEAD)
    t.add_column("")
    for name in names:
        t.add_column(f"gpu-{name}", justify="right")
    for col in ("broker", "engine alone", "FIFO"):
        t.add_column(col, justify="right")
    for row in _rows(report):
        t.add_row(row.label, *[row.broker(report["consumers"][n]) for n in names], row.broker(report["total"]),
                  row.simulated(report["engine_alone"]), row.simulated(report["fifo"]))
    return t


def _producer_line(name: str, p: dict) -> str:
    how = "one at a time" if name == "chat" else "in chunks with submit_many"
    checked = ("verified: each exactly once, ok, the simulated engine's tokens" if p["verified"] else
               f"[red]NOT verified: missing {p['missing']}, duplicates {p['duplicates']}, foreign {p['foreign']}, "
               f"not ok {p['not_ok']}, token mismatches {p['token_mismatches']}[/]")
    return (f"  {name}: {p['items']:,} prompts submitted {how} ({_millions(p['tokens'])} tokens in, "
            f"{_millions(p['output_tokens'])} out), every result in {p['seconds']:.1f} s wall "
            f"({p['items_per_s']:,.0f} items/s); {checked}")


def print_summary(report: dict, console=None) -> None:
    from rich.console import Console

    console = console or Console()
    console.print(f"[bold]{headline(report)}[/]")
    console.print(verdict(report))
    console.print(_table(report))
    console.print("  makespan: the slower consumer's engine seconds (they run side by side); idle: wall seconds "
                  "a GPU process had nothing to run (not in its engine seconds); refused: batches a consumer's "
                  f"shape guard refused. The broker: `shmbroker supervise` (instance {report['instance']}), "
                  f"its built-in consumers paced at {report['pace_seconds']} wall s per modeled s; {report['workload']}.")
    for name, p in report["producers"].items():
        console.print(_producer_line(name, p))
    w, left = report["wall"], report["shm_left"]
    console.print(f"broker stopped: exit {report['exit_code']} in {w['stop_seconds']:.1f} s, "
                  + ("no shared memory of its instance left" if not left else f"[red]LEFT: {', '.join(left)}[/]")
                  + f"; started in {w['broker_start_seconds']:.1f} s; the engine alone simulated in "
                  f"{w['engine_alone_simulation_seconds']:.1f} s, FIFO in {w['fifo_simulation_seconds']:.1f} s")
    if report.get("data_dir"):
        console.print(f"[red]the broker's data directory and log are kept in {report['data_dir']}[/]")
