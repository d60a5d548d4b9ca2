"""The ingest processes (`ingest-N`): drain every producer's ingest ring into the backlog.

`sources` is the consumer side of the producers' rings; `loop` validates records, appends them to
the backlog's segment files (a record leaves its ring only once it is committed on disk) and
announces each appended run to the scheduler on the "appended" ring.
"""
