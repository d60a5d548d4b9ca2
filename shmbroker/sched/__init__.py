"""The scheduler process (`sched`): the single owner of the packing index.

`scheduler` takes the ingest processes' announcements into the index (`pack/`), picks a shape for
each consumer and packs batch descriptors to its contract, keeping every consumer's batch ring
ahead of its engine. It owns its collaborators: `slots` (the index slots: each indexed item's
location, the free ones, arrivals), `admission` (fails back what no consumer can ever take and
what a cancelled job submitted), `beyond` (what waits for room in the index, in memory and on
disk), `records` (batch records, the failed rows waiting for one, each consumer's ring); `pending`
is the scheduler's statistics words and gauges.
"""
