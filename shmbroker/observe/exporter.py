"""The Prometheus exporter: a process of the broker serving /metrics from the statistics in shared memory.

The supervisor binds the listening socket (`metrics_addr`, default 127.0.0.1:9464; port 0 picks a
free one, published in the control segment and `broker.json`) before it forks, so a taken address
fails the start with a clear error, and forks the `metrics` process to serve it. Each scrape takes
one snapshot (`watch.BrokerView.snapshot`: seqlock copies of every process's slot, ring headers,
a listing of the backlog directory) and turns it into metric families in `BrokerCollector`: the
broker's processes make no Python call per event for it, and nothing on their hot path waits.

Names: `shmbroker_` + what + unit, `_total` on counters (prometheus-client appends it), labels
`consumer`, `model`, `reason`, `process`, `ring`, `kind`, `ingest`. The table of which statistic
feeds which metric is `stats.STATS`; the extra families (ratios, contracts, processes, rings,
backlog on disk) are built below. Rates are left to PromQL (`rate(...[1m])`).
"""

from __future__ import annotations

import socket
import time
from http.server import HTTPServer

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import CollectorRegistry

from ..control.roles import Kind, parse
from ..control.segment import beat
from ..control.stats import COUNTER, STATS
from ..errors import BrokerError
from .watch import BrokerView, lower_priority

PREFIX = "shmbroker_"
SERVE_SLICE_SECONDS = 0.25  # the serving loop beats and checks for a stop this often
CLIENT_TIMEOUT_SECONDS = 5.0  # a scraper that stalls mid-request is dropped after this


class _Families:
    """Metric families by name, created on first use with their kind, help and label names."""

    def __init__(self):
        self.by_name: dict[str, object] = {}

    def add(self, kind: str, metric: str, help_text: str, labels: dict, value: float) -> None:
        fam = self.by_name.get(metric)
        if fam is None:
            name = PREFIX + (metric[: -len("_total")] if kind == COUNTER else metric)
            cls = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            fam = self.by_name[metric] = cls(name, help_text, labels=list(labels))
        fam.add_metric(list(labels.values()), value)


class BrokerCollector:
    """prometheus-client collector: every scrape reads one snapshot of the broker."""

    def __init__(self, view: BrokerView):
        self.view = view
        self.scrapes = 0
        self.scrape_seconds = 0.0

    def collect(self):
        t0 = time.perf_counter()
        snap = self.view.snapshot()
        f = _Families()
        _role_metrics(f, self.view, snap)
        _consumer_metrics(f, snap)
        _backlog_metrics(f, snap)
        _process_metrics(f, snap)
        _ring_metrics(f, snap)
        _job_metrics(f, snap)
        f.add("gauge", "broker_up", "1 while the broker's supervisor runs.", {}, 1.0 if snap["alive"] else 0.0)
        f.add("gauge", "broker_stopping", "1 while a graceful stop is under way.", {}, float(snap["stopping"]))
        f.add("gauge", "broker_start_time_seconds", "Unix time the broker started.", {}, snap["started_unix"])
        f.add("gauge", "producers", "Producers the broker has given a name and rings.", {}, len(snap["producers"]))
        self.scrapes += 1
        self.scrape_seconds += time.perf_counter() - t0
        f.add(COUNTER, "exporter_scrapes_total", "Scrapes served.", {}, self.scrapes)
        f.add(COUNTER, "exporter_scrape_seconds_total", "Seconds spent building scrapes.", {}, self.scrape_seconds)
        yield from f.by_name.values()


def _role_metrics(f: _Families, view: BrokerView, snap: dict) -> None:
    """The exported fields of every process's statistics (`stats.STATS`)."""
    consumers = {c["name"]: c for c in view.desc["consumers"]}
    for r, role in enumerate(view.roles):
        who = parse(role)
        fields = STATS.get(who.kind)
        if not fields:
            continue
        values = view.last_values.get(r, {})
        if who.kind is Kind.GPU:
            labels = {"consumer": who.label, "model": consumers[who.label]["model"]}
        elif who.kind is Kind.INGEST:
            labels = {"ingest": who.label}
        else:
            labels = {}
        for field in fields:
            if field.metric is None or field.key not in values:
                continue
            f.add(field.kind, field.metric, field.help, {**labels, **dict(field.labels)},
                  values[field.key] * field.scale)


def _consumer_metrics(f: _Families, snap: dict) -> None:
    for name, c in snap["consumers"].items():
        labels = {"consumer": name, "model": c["model"]}
        f.add("gauge", "consumer_info", "A consumer's engine and mode (value 1).",
              {**labels, "engine": c["engine"], "mode": c["mode"]}, 1.0)
        f.add("gauge", "consumer_max_batch_size", "The consumer's contract: items per batch.", labels,
              c["max_batch_size"])
        f.add("gauge", "consumer_max_batch_tokens", "The consumer's contract: tokens per batch.", labels,
              c["max_batch_tokens"])
        f.add("gauge", "consumer_max_input_tokens", "The consumer's contract: tokens per item.", labels,
              c["max_input_len"])
        for key, metric, text in (
                ("padding_waste", "consumer_padding_waste_ratio",
                 "Padded / rectangle tokens over the broker's life (0 for a packed engine's ideal)."),
                ("hit_rate", "consumer_cache_hit_ratio", "Cache-hit / queried prefix blocks over the broker's life."),
                ("batch_fill", "consumer_batch_fill_ratio", "Input tokens / (batches x max_batch_tokens).")):
            if c.get(key) is not None:
                f.add("gauge", metric, text, labels, c[key])


def _backlog_metrics(f: _Families, snap: dict) -> None:
    b = snap["backlog"]
    for model, m in b["models"].items():
        f.add("gauge", "backlog_pending_items", "Items waiting for a batch, per model.", {"model": model}, m["items"])
        f.add("gauge", "backlog_pending_tokens", "Tokens waiting for a batch, per model.", {"model": model},
              m["tokens"])
    f.add("gauge", "backlog_oldest_item_age_seconds", "Age of the oldest waiting item (since the scheduler took it).",
          {}, b["oldest_age_seconds"])
    f.add("gauge", "backlog_segments", "Backlog segment files on disk.", {}, b["segments"])
    f.add("gauge", "backlog_disk_bytes", "Bytes of the backlog directory on disk.", {}, b["disk_bytes"])


def _job_metrics(f: _Families, snap: dict) -> None:
    """Jobs per status (all of them), and the live jobs' counts per job name (bounded: live jobs only)."""
    jobs = snap["jobs"]
    for status, n in jobs["by_status"].items():
        f.add("gauge", "jobs", "Batch jobs in the data directory, per status.", {"status": status}, n)
    for j in jobs["live"]:
        for state in ("total", "submitted", "completed", "failed", "cancelled"):
            f.add("gauge", "job_items", "Items of a live batch job (not completed, cancelled or failed), per state.",
                  {"job": j["name"], "status": j["status"], "state": state}, j[state])


def _process_metrics(f: _Families, snap: dict) -> None:
    for p in snap["processes"]:
        labels = {"process": p["role"], "kind": p["kind"]}
        f.add("gauge", "process_up", "1 while the broker process runs.", labels, 1.0 if p["alive"] else 0.0)
        f.add(COUNTER, "process_restarts_total", "Times the supervisor restarted the process.", labels, p["restarts"])
        f.add("gauge", "process_pid", "The process's pid (0: not running).", labels, p["pid"])
        if p["heartbeat_age_seconds"] is not None:
            f.add("gauge", "process_heartbeat_age_seconds", "Seconds since the process's loop last beat.", labels,
                  p["heartbeat_age_seconds"])
        f.add(COUNTER, "process_compiles_total", "numba compilations in the process (0 expected).", labels,
              p["compiles"])
        f.add("gauge", "process_crash_loop", "1 while the process crash-loops (dies soon after each restart).",
              labels, 1.0 if p.get("crash_loop") else 0.0)
        f.add(COUNTER, "process_watchdog_kills_total", "Times the supervisor's watchdog killed the process as hung.",
              labels, p.get("watchdog_kills", 0))
        error = p.get("last_error")
        f.add("gauge", "process_last_exit_info", "The process's last death in words (value 1; 0 and error \"\": it "
              "never died): status or signal, the watchdog's reason, the exception line.",
              {**labels, "error": (error or "")[:LABEL_CHARS_MAX]}, 1.0 if error else 0.0)
        f.add("gauge", "process_last_exit_time_seconds", "Unix time of the process's last death (0: it never died).",
              labels, p.get("last_exit_unix") or 0.0)


PRODUCER_RING_KINDS = ("ingest", "results")
LABEL_CHARS_MAX = 160  # of a process's last error as a label value (one series per process at a time)


def _ring_metrics(f: _Families, snap: dict) -> None:
    """The broker's own rings one by one (their number is fixed by the configuration); producers'
    rings summed per kind, so that producer names (`submit-<pid>`, ...) never become label values."""
    agg = {k: {"used": 0.0, "full": 0, "pushed": 0, "rings": 0} for k in PRODUCER_RING_KINDS}
    for ring in snap["rings"]:
        kind = ring["kind"]
        if kind in agg:
            a = agg[kind]
            a["used"] = max(a["used"], ring["occupancy"])
            a["full"] += ring["full_total"]
            a["pushed"] += ring["pushed_total"]
            a["rings"] += 1
            continue
        labels = {"ring": ring["ring"], "kind": kind}
        f.add("gauge", "ring_used_ratio", "Share of the ring holding records not yet consumed.", labels,
              ring["occupancy"])
        f.add("gauge", "ring_capacity_bytes", "The ring's data bytes.", labels, ring["capacity_bytes"])
        f.add(COUNTER, "ring_full_total", "Pushes the ring refused because it was full.", labels, ring["full_total"])
        f.add(COUNTER, "ring_pushed_records_total", "Records pushed onto the ring.", labels, ring["pushed_total"])
    for kind, a in agg.items():
        labels = {"kind": kind}
        f.add("gauge", "producer_rings", "Producers' rings of this kind (one per producer).", labels, a["rings"])
        f.add("gauge", "producer_ring_used_ratio_max", "The fullest producer ring of this kind: its used share.",
              labels, a["used"])
        f.add(COUNTER, "producer_ring_full_total", "Pushes refused by full producer rings of this kind, summed.",
              labels, a["full"])
        f.add(COUNTER, "producer_ring_pushed_records_total", "Records pushed onto producer rings of this kind, summed.",
              labels, a["pushed"])


# -- the process --------------------------------------------------------------------------------

class ExporterAddressError(BrokerError):
    """The exporter cannot listen on `metrics_addr` (taken, or not an address of this host)."""


def bind(addr: tuple[str, int], key: str = "metrics_addr", backlog: int = 16) -> socket.socket:
    """The listening socket (the supervisor binds it before it forks, so a taken address fails the start);
    `key` names the setting in an error (the exporter's, or `http.addr`)."""
    host, port = addr
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ExporterAddressError(f"{key} {host}:{port}: {exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ExporterAddressError(f"{key} {host}:{port}: {exc.strerror} (set {key} to a free address"
                                   + (", or to \"\" to run without the exporter)" if key == "metrics_addr" else ")")) from None
    return sock


def addr_text(sock: socket.socket) -> str:
    """A bound socket's address as `host:port` (`[host]:port` for IPv6): what broker.json shows."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Server(HTTPServer):
    def __init__(self, sock: socket.socket, handler):
        super().__init__(sock.getsockname()[:2], handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.timeout = SERVE_SLICE_SECONDS

    def get_request(self):
        conn, addr = super().get_request()
        conn.settimeout(CLIENT_TIMEOUT_SECONDS)
        return conn, addr


def metrics_main(view: BrokerView, sock: socket.socket, slot, stopping) -> None:
    """The `metrics` process: serve /metrics on `sock` until stopped, one request at a time. It runs at
    a lower CPU priority (`watch.lower_priority`): on a busy host a scrape waits, the broker does not."""
    lower_priority()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(view))
    server = _Server(sock, MetricsHandler.factory(registry))
    try:
        while not stopping():
            beat(slot)
            server.handle_request()
    finally:
        server.server_close()
        view.close()
