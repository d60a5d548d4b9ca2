"""Progress of a submit or a job: a rich display on a terminal, one plain line every few seconds without.

Both show the same figures: items submitted (of the job's lines), results in, ok and failed,
generated tokens per second, the time elapsed and an estimate of the time left (from the rate of
results so far). `update` only stores the figures: the terminal display redraws on rich's own
refresh thread (a few times a second) and the plain line is written when its interval is up, so
a caller may update after every chunk at no cost.
"""

from __future__ import annotations

import sys
import time

PLAIN_SECONDS = 5.0  # between two plain lines
REFRESH_PER_SECOND = 4


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class Figures:
    def __init__(self, total: int):
        self.total = total
        self.submitted = 0
        self.results = 0
        self.ok = 0
        self.failed = 0
        self.tokens = 0  # generated
        self.status = ""
        self.t0 = time.monotonic()

    def rates(self) -> tuple[float, float, float | None]:
        """(elapsed seconds, generated tokens/s, seconds left or None)."""
        elapsed = max(1e-9, time.monotonic() - self.t0)
        left = None
        if self.results and self.total:
            left = max(0.0, self.total - self.results) * elapsed / self.results
        return elapsed, self.tokens / elapsed, left

    def line(self, label: str) -> str:
        elapsed, tps, left = self.rates()
        status = f" [{self.status}]" if self.status else ""
        return (f"{label}{status}: {self.submitted:,}/{self.total:,} submitted, {self.results:,} results "
                f"(ok {self.ok:,}, failed {self.failed:,}), {tps:,.0f} tokens/s, {_clock(elapsed)} elapsed, "
                f"~{_clock(left)} left")


class Progress:
    """`with Progress(label, total) as p: p.update(submitted=..., results=..., ...)`"""

    def __init__(self, label: str, total: int, stream=None, tty: bool | None = None,
                 plain_seconds: float | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.label = label
        self.fig = Figures(total)
        self.plain_seconds = PLAIN_SECONDS if plain_seconds is None else max(0.05, plain_seconds)
        self._next_plain = time.monotonic() + self.plain_seconds
        self._live = None

    def __enter__(self) -> Progress:
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self, console=Console(file=self.stream), refresh_per_second=REFRESH_PER_SECOND,
                              transient=False)
            self._live.start()
        return self

    def __rich__(self):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        f = self.fig
        elapsed, tps, left = f.rates()
        grid = Table.grid(padding=(0, 1))
        grid.add_row(f"[bold]{self.label}[/]" + (f" [{f.status}]" if f.status else ""),
                     ProgressBar(total=max(1, f.total), completed=f.results, width=30),
                     f"{f.results:,}/{f.total:,} results")
        grid.add_row("", f"submitted {f.submitted:,}  ok [green]{f.ok:,}[/]  failed [red]{f.failed:,}[/]",
                     f"{tps:,.0f} tokens/s  {_clock(elapsed)} elapsed  ~{_clock(left)} left")
        return grid

    def update(self, **figures) -> None:
        for k, v in figures.items():
            setattr(self.fig, k, v)
        if not self.tty and time.monotonic() >= self._next_plain:
            self.plain()

    def plain(self) -> None:
        self._next_plain = time.monotonic() + self.plain_seconds
        print(f"shmbroker: {self.fig.line(self.label)}", file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None
        else:
            self.plain()  # the last figures
