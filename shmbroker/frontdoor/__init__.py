"""The front door: how a producer gets its rings, run by the supervisor process as a thread.

`registry` serves a Unix socket in the data directory (owner-only): a producer names itself, the
registry checks its peer credentials, creates or reattaches its ingest and result rings and enters
it in the producer table of the control segment; `producer_book` keeps every producer id ever given
out, by name, on disk, so that ids survive restarts.
"""
