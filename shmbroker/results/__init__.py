"""The results process (`results`): the durable results log, delivery to producers, the backlog's acks.

`router` reads every GPU process's results ring, appends to the results log (`log`), routes each
result to its producer's result ring (`delivery`) and acks the backlog; `replay` re-reads the log
after a restart; `cursor_save` keeps each producer name's delivery cursor; `behind` moves the
results of a name that reads far behind into a log of its own.
"""
