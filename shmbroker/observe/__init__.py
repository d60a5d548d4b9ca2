"""Watching a running broker without touching it: `status`, `shmbroker top` and the Prometheus exporter.

`watch` reads the control segment, the statistics and the files on disk read-only (`BrokerView`);
`top` draws it live in a terminal; `exporter` is the broker's exporter process, serving /metrics
from the same view.
"""
