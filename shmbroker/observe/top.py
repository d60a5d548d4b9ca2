"""`shmbroker top`: a live terminal view of a running broker, refreshed at least twice a second.

`top` is a watcher like `status` and the exporter: it attaches read-only (`watch.BrokerView`), so
looking at a busy broker costs it nothing: no RPC, no lock, no write. Rates are taken over the
last RATE_WINDOW_SECONDS of snapshots rather than the last refresh, because consumers finish work
in whole batches and a half-second rate jumps between zero and twice the truth.

When no broker runs on the data directory `top` says so (the `NoBroker` message) and keeps looking;
when the broker it watches goes away it drops the view and goes back to looking. It never needs a
broker to exit: `q`, Ctrl-C and SIGTERM all end it with status 0 and the terminal as it found it,
Ctrl-C also when top was started with SIGINT ignored (it installs Python's handler itself).

The rendering (`render`, `waiting`) is pure: snapshot dicts in, a rich renderable out, so tests
check it without a terminal. `run` is the loop around it: a `Keys` reader (cbreak mode only when
stdin is a terminal) whose `select` timeout is the refresh interval.

`top` watches at idle priority, but quitting is the user's wait: on a busy host a SCHED_IDLE
process gets almost no CPU, and the interpreter's exit alone (its collections walking numba's and
rich's objects, about 0.4 s of CPU) would take tens of seconds after Ctrl-C. So on quitting `run`
goes back to the priority it started with where the kernel allows (root, CAP_SYS_NICE, RLIMIT_NICE)
and freezes the heap, which leaves the exit about a quarter of that work.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import sys
import termios
import time
import tty
from collections import deque

from rich.console import Group, RenderableType
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .watch import format_bytes

INTERVAL_SECONDS_MAX = 0.5  # the screen is refreshed at least twice a second
RATE_WINDOW_SECONDS = 2.0
HISTORY_MAX = 64  # snapshots kept for the rate window (a bound; below 2 s / 64 a refresh, the window is shorter)
STALE_HEARTBEAT_SECONDS = 2.0
CONSUMERS_PER_ROW = 4
CONSUMER_ROWS = 10  # lines in a consumer panel (keep in step with _consumer)
JOBS_SHOWN = 8  # live jobs in the jobs panel (the newest)


# -- rendering (pure) ----------------------------------------------------------------------------

def window(a: dict, b: dict) -> dict:
    """`watch.rates` between two snapshots, plus each consumer's average batch wait over them."""
    from .watch import rates

    out = rates(a, b)
    for name, rate in out["consumers"].items():
        x, y = a["consumers"].get(name, {}), b["consumers"][name]
        batches = y.get("batches", 0) - x.get("batches", 0)
        wait_ns = y.get("batch_wait_ns", 0) - x.get("batch_wait_ns", 0)
        rate["batch_wait_seconds"] = wait_ns / batches / 1e9 if batches > 0 else None
    return out


def _num(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(fraction) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def _duration(seconds) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s"


def _pairs(rows: list[tuple[str, str | Text]]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True, min_width=max(len(label) for label, _ in rows))
    t.add_column(justify="right", no_wrap=True, overflow="ellipsis")
    for label, value in rows:
        t.add_row(label, value)
    return t


def _failed(c: dict) -> Text:
    reasons = {"too long": c.get("too_long", 0), "invalid": c.get("invalid", 0), "engine": c.get("engine_errors", 0),
               "corrupt": c.get("corrupt", 0)}
    total = sum(reasons.values())
    detail = ", ".join(f"{why} {n:,}" for why, n in reasons.items() if n)
    return Text(f"{total:,}" + (f" ({detail})" if detail else ""), style="red" if total else "")


def _consumer(c: dict, rate: dict) -> Panel:
    busy, guard, wait = rate.get("busy_fraction"), c.get("guard_violations", 0), rate.get("batch_wait_seconds")
    rows = [
        ("tokens/s", _num(rate.get("tokens_per_second"))),
        ("items/s", _num(rate.get("items_per_second"), 1)),
        ("padding waste", _pct(c.get("padding_waste"))),
        ("cache hit rate", _pct(c.get("hit_rate"))),
        ("shape switches", f"{c.get('shape_switches', 0):,} ({c.get('excess_shape_switches', 0):,} excess)"),
        ("busy", _pct(busy)),
        ("batch wait", "-" if wait is None else f"{wait * 1e3:,.2f} ms"),
        ("batches / items", f"{c.get('batches', 0):,} / {c.get('items', 0):,}"),
        ("failed items", _failed(c)),
        ("guard refusals", Text(f"{guard:,}", style="bold red" if guard else "")),
    ]
    assert len(rows) == CONSUMER_ROWS
    title = Text.assemble((c.get("name", "?"), "bold cyan"), f"  {c.get('model')} · {c.get('engine')}/{c.get('mode')}")
    return Panel(_pairs(rows), title=title, title_align="left")


def _backlog(b: dict) -> Panel:
    rows = [("pending items", _num(b.get("pending_items"))), ("pending tokens", _num(b.get("pending_tokens")))]
    for model, m in b.get("models", {}).items():
        rows.append((f"  {model}", f"{m['items']:,} items, {m['tokens']:,} tokens"))
    rows += [("families", _num(b.get("families"))), ("oldest item", _duration(b.get("oldest_age_seconds"))),
             ("segments", _num(b.get("segments"))), ("on disk", format_bytes(b.get("disk_bytes", 0))),
             ("waiting on disk", _num(b.get("waiting_items"))), ("in memory beyond", _num(b.get("overflow_items")))]
    return Panel(_pairs(rows), title="backlog", title_align="left")


def _ingest(ing: dict, rate: dict) -> Panel:
    rows = [("items/s", _num(rate.get("items_per_second"), 1)), ("tokens/s", _num(rate.get("tokens_per_second"))),
            ("MB/s", _num(None if "bytes_per_second" not in rate else rate["bytes_per_second"] / 1e6, 2)),
            ("items total", _num(ing.get("items"))), ("tokens total", _num(ing.get("tokens"))),
            ("MB total", _num(ing.get("bytes", 0) / 1e6, 2)), ("disk-full refusals", _num(ing.get("disk_full")))]
    return Panel(_pairs(rows), title="ingest", title_align="left")


def _cluster(c: dict, rate: dict) -> Panel:
    """A node's bridge: its partitions and leases, JetStream's pending, the bridge's rates."""
    rows = [("node", c.get("node", "-")), ("partitions", f"{_num(c.get('partitions'))} of {_num(c.get('num_partitions'))}"
                                           f" ({_num(c.get('draining'))} draining)"),
            ("live nodes", _num(c.get("live_nodes"))), ("connected", "yes" if c.get("connected") else "NO"),
            ("pending in JetStream", _num(c.get("stream_items"))), ("staged here", _num(c.get("staged_items"))),
            ("pulled/s", _num(rate.get("pulled_per_second"), 1)), ("published/s", _num(rate.get("published_per_second"), 1)),
            ("leases taken/lost", f"{_num(c.get('leases_taken'))} / {_num(c.get('leases_lost'))}"),
            ("refused, fenced", f"{_num(c.get('refused'))}, {_num(c.get('fenced'))}")]
    return Panel(_pairs(rows), title="cluster", title_align="left")


def _jobs(jobs: dict) -> Panel:
    """The live jobs (not completed, cancelled or failed), and how many jobs are in each status."""
    t = Table(expand=True, box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    for col in ("job", "status", "done", "failed", "cancelled"):
        t.add_column(col, justify="left" if col in ("job", "status") else "right", no_wrap=True)
    for j in jobs["live"][-JOBS_SHOWN:]:
        done = j["completed"] + j["failed"] + j["cancelled"]
        t.add_row(j["name"], j["status"], f"{done:,}/{j['total']:,}", _num(j["failed"]), _num(j["cancelled"]))
    others = ", ".join(f"{n} {s}" for s, n in jobs["by_status"].items() if n and s in ("completed", "cancelled", "failed"))
    return Panel(t, title=f"jobs ({others})" if others else "jobs", title_align="left")


def _processes(processes: list[dict]) -> Panel:
    t = Table(expand=True, box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, header_style="bold")
    for col in ("role", "pid", "alive", "restarts", "hung", "beat"):
        t.add_column(col, justify="left" if col == "role" else "right", no_wrap=True,
                     min_width=len("CRASH LOOP") if col == "alive" else None)
    t.add_column("last error", no_wrap=True, overflow="ellipsis", ratio=1)  # what room is left
    for p in processes:
        age = p.get("heartbeat_age_seconds")
        stale = age is None or age > STALE_HEARTBEAT_SECONDS
        looping = p.get("crash_loop")
        style = "bold red" if not p["alive"] or looping else "yellow" if stale else ""
        t.add_row(p["role"], str(p["pid"] or "-"), "CRASH LOOP" if looping else "yes" if p["alive"] else "DEAD",
                  str(p["restarts"]), str(p.get("watchdog_kills", 0)),
                  "-" if age is None else f"{age:.2f}s" + (" STALE" if stale else ""), p.get("last_error") or "",
                  style=style)
    return Panel(t, title="processes", title_align="left")


def _rings(rings: list[dict]) -> Panel:
    t = Table(expand=True, box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, header_style="bold")
    for col in ("ring", "used", "full"):
        t.add_column(col, justify="left" if col == "ring" else "right", no_wrap=True, overflow="ellipsis")
    for r in rings:
        occ = r["occupancy"]
        t.add_row(r["ring"], Text(f"{occ * 100:.1f}%", style="red" if occ > 0.9 else "yellow" if occ > 0.5 else ""),
                  Text(f"{r['full_total']:,}", style="yellow" if r["full_total"] else ""))
    return Panel(t, title="rings", title_align="left")


def _header(snap: dict) -> Text:
    head = Text(no_wrap=True, overflow="ellipsis")
    head.append("shmbroker top", style="bold")
    head.append(f"  {snap['data_dir']}  instance {snap.get('instance')}  supervisor pid {snap['pid']}"
                f"  up {_duration(snap.get('uptime_seconds'))}  {len(snap.get('producers', []))} producer(s)")
    if snap.get("stopping"):
        head.append("  STOPPING", style="bold red")
    head.append("  press q to quit", style="dim")
    return head


def render(snapshot: dict, rates: dict) -> RenderableType:
    """One screen of a broker: `snapshot` from `BrokerView.snapshot`, `rates` from `window` (or `watch.rates`)."""
    panels = [_consumer(c, rates.get("consumers", {}).get(name, {})) for name, c in snapshot["consumers"].items()]
    rows = [panels[i : i + CONSUMERS_PER_ROW] for i in range(0, len(panels), CONSUMERS_PER_ROW)]
    consumers = Layout(name="consumers", size=len(rows) * (CONSUMER_ROWS + 2))
    consumers.split_column(*(Layout(name=f"consumers{i}") for i in range(len(rows))))
    for part, row in zip(consumers.children, rows):
        part.split_row(*(Layout(p) for p in row))
    backlog = _backlog(snapshot["backlog"])
    left = Layout(name="left")
    parts = [Layout(backlog, size=backlog.renderable.row_count + 2)]
    if snapshot.get("cluster"):
        cluster = _cluster(snapshot["cluster"], rates.get("cluster", {}))
        parts.append(Layout(cluster, size=cluster.renderable.row_count + 2))
    jobs = snapshot.get("jobs") or {"live": [], "by_status": {}}
    if jobs["live"] or any(jobs["by_status"].values()):
        parts.append(Layout(_jobs(jobs), size=min(len(jobs["live"]), JOBS_SHOWN) + 3))
    left.split_column(*parts, Layout(_ingest(snapshot["ingest"], rates.get("ingest", {}))))
    right = Layout(name="right")
    right.split_column(Layout(_processes(snapshot["processes"]), size=len(snapshot["processes"]) + 3),
                       Layout(_rings(snapshot["rings"])))
    bottom = Layout(name="bottom")
    bottom.split_row(left, right)
    screen = Layout()
    screen.split_column(Layout(_header(snapshot), size=1), consumers, bottom)
    return screen


def waiting(data_dir: str, message: str) -> RenderableType:
    """The screen while no broker runs on `data_dir`."""
    body = Group(Text(message, style="bold yellow"),
                 Text(f"\nwaiting for a broker on {data_dir} (looking again every refresh); press q to quit", style="dim"))
    return Panel(body, title="shmbroker top", title_align="left")


# -- the loop ------------------------------------------------------------------------------------

class Quit(Exception):
    """SIGTERM: leave the view as `q` does."""


def _on_sigterm(signum, frame) -> None:
    raise Quit()


class Keys:
    """Key presses from stdin when it is a terminal (cbreak mode while entered, restored on exit);
    otherwise `wait` only sleeps and Ctrl-C or SIGTERM end `top`."""

    def __init__(self, stream):
        try:
            fd = stream.fileno() if stream is not None else None
        except (OSError, ValueError):  # closed, or not a real file
            fd = None
        self.fd = fd if fd is not None and os.isatty(fd) else None  # None: no keys to read
        self._tty = self.fd
        self._saved = None

    def __enter__(self) -> Keys:
        if self._tty is not None:
            self._saved = termios.tcgetattr(self._tty)
            tty.setcbreak(self._tty, termios.TCSANOW)  # keeps keys typed before top was up (a q)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            try:
                termios.tcsetattr(self._tty, termios.TCSADRAIN, self._saved)
            except termios.error:  # the terminal is gone: nothing left to restore
                pass
            self._saved = None

    def wait(self, timeout_seconds: float) -> bool:
        """True as soon as `q` is pressed; False after `timeout_seconds` without it."""
        deadline = time.monotonic() + timeout_seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.fd is None:
                time.sleep(left)
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                data = os.read(self.fd, 64)
                if not data:  # the terminal hung up: no more keys, only signals
                    self.fd = None
                elif b"q" in data.lower():
                    return True
        return False


class Top:
    """The view of one data directory: attaches when a broker appears, detaches when it goes."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.view = None
        self.history: deque[dict] = deque(maxlen=HISTORY_MAX)

    def frame(self) -> RenderableType:
        from .watch import BrokerView, NoBroker

        if self.view is None:
            try:
                self.view = BrokerView.attach(self.data_dir)
            except NoBroker as exc:
                return waiting(self.data_dir, str(exc))
            self.history.clear()
        try:
            if not self.view.alive():
                raise NoBroker(f"supervisor pid {self.view.desc['pid']} exited")
            snap = self.view.snapshot()
        except (NoBroker, OSError, ValueError) as exc:
            self.close()
            return waiting(self.data_dir, f"no broker is running on data directory {self.data_dir!r} (the broker went away: {exc})")
        self.history.append(snap)
        while len(self.history) > 2 and snap["t_monotonic_ns"] - self.history[1]["t_monotonic_ns"] >= RATE_WINDOW_SECONDS * 1e9:
            self.history.popleft()
        return render(snap, window(self.history[0], snap))

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None


def _priority() -> tuple[int, os.sched_param, int] | None:
    """This thread's scheduling policy, its parameter and its nice value; None where unknown."""
    try:
        return os.sched_getscheduler(0), os.sched_getparam(0), os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return None


def _restore_priority(saved: tuple[int, os.sched_param, int] | None) -> None:
    """Back to `saved` (from `_priority`), best effort: an ordinary user may not leave SCHED_IDLE
    or lower its nice value (RLIMIT_NICE), and then stays where it is."""
    if saved is None:
        return
    policy, param, nice = saved
    try:
        os.sched_setscheduler(0, policy, param)
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass


def run(data_dir: str, interval_seconds: float = INTERVAL_SECONDS_MAX) -> int:
    """Show the broker on `data_dir` until `q`, Ctrl-C or SIGTERM; 0 then. The process is meant to
    end once it returns: it leaves the interpreter's heap frozen (`gc.freeze`) for a cheap exit."""
    assert 0 < interval_seconds <= INTERVAL_SECONDS_MAX
    from .watch import lower_priority

    started = _priority()
    lower_priority()  # a watcher yields the CPU to the broker it watches
    previous = {signal.SIGINT: signal.getsignal(signal.SIGINT), signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Ctrl-C quits even when top was started with SIGINT ignored (from a script or a background job
    # that ignores it: the terminal's Ctrl-C still reaches a foreground top, and Python would drop it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    top = Top(data_dir)
    try:
        with Keys(sys.stdin) as keys, Live(screen=True, auto_refresh=False, redirect_stderr=False) as live:
            try:
                next_frame = time.monotonic()
                while True:
                    live.update(top.frame(), refresh=True)
                    next_frame = max(next_frame + interval_seconds, time.monotonic())  # a period, not a pause
                    if keys.wait(max(0.0, next_frame - time.monotonic())):
                        break
            except (KeyboardInterrupt, Quit):
                pass
            finally:  # a second Ctrl-C or SIGTERM must not cut the terminal's restoration short
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                _restore_priority(started)  # quitting is not watching: no idle priority for it
    except (KeyboardInterrupt, Quit):  # while the terminal was being set up
        pass
    finally:
        _restore_priority(started)
        top.close()
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        gc.freeze()  # the exit's collections skip what exists now; the process's end frees it all
    return 0
