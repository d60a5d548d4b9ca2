"""The results process (`results`): the durable results log, delivery to producers, the backlog's acks.

`router` reads every GPU process's results ring, appends to the results log (`log`), routes each
result to its producer's result ring (`delivery`) and acks the backlog. It owns its collaborators:
`recipients` (who a result goes to, what is parked for whom), `behind` (the names read far
behind, their results in a log of their own), `cursor_save` (each producer name's delivery
cursor, saved, and the log trims it allows) and `replay` (the logs re-read after a restart).
`routed` holds what a route works on, the ring record being taken among them; `slots` names the
results role's statistics.
"""
