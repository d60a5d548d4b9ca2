"""The scheduler process (`sched`): the single owner of the packing index.

`scheduler` takes the ingest processes' announcements into the index (`pack/`), picks a shape for
each consumer and packs batch descriptors to its contract, keeping every consumer's batch ring
ahead of its engine; `admission` fails back what no consumer can ever take and what a cancelled
job submitted; `pending` is the scheduler's statistics words and gauges.
"""
