"""The NATS permissions that keep each producer to its own results: an `authorization` block for
the servers' configuration.

A producer `<p>` may publish prompts to any partition, and nothing else of the cluster but
constraints' payloads to the payloads bucket (a node uses a value only when it hashes to its key's
digest: a producer that overwrote another's payload would fail its items `corrupt`, never change
their constraint). It may read only its own results: the consumer `res-<p>` of the results stream
(create, info, next, ack), its own sequence-block key `seq.<p>` of the leases bucket, and replies
on its own inbox prefix `_INBOX_<p>` (`RemoteProducer` connects with it; a shared `_INBOX.>` would
let one producer subscribe to the replies another's pull requests get, which carry its results).
Nodes and the operator are trusted: they hold the whole cluster's rights. The streams, the buckets
and the consumers are created by a node (or the operator) before producers with these permissions
connect: such a producer runs with `create_streams=False`.

    print(authorization_block(ClusterNames(), producers={"alice": "pw1"}, trusted={"node": "pw2"}))
"""

from __future__ import annotations

import json

from .subjects import ClusterNames, check_producer_name


def inbox_prefix(producer: str) -> str:
    """The inbox prefix of a producer's connection: its replies, and only its, come there."""
    return f"_INBOX_{check_producer_name(producer)}"


def producer_permissions(names: ClusterNames, producer: str) -> dict:
    """What producer `producer` may publish and subscribe to (nats-server `permissions`)."""
    p = check_producer_name(producer)
    res, consumer, kv = names.results_stream, names.results_consumer(p), f"KV_{names.leases_bucket}"
    seq_subject = f"$KV.{names.leases_bucket}.{names.seq_key(p)}"
    api = "$JS.API"
    return {
        "publish": {"allow": [
            names.prompts_subjects,
            f"$KV.{names.payloads_bucket}.*",
            f"{api}.INFO",
            f"{api}.STREAM.INFO.{names.prompts_stream}",
            f"{api}.STREAM.INFO.{res}",
            f"{api}.CONSUMER.CREATE.{res}.{consumer}",
            f"{api}.CONSUMER.CREATE.{res}.{consumer}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{res}.{consumer}",
            f"{api}.CONSUMER.INFO.{res}.{consumer}",
            f"{api}.CONSUMER.MSG.NEXT.{res}.{consumer}",
            f"$JS.ACK.{res}.{consumer}.>",
            f"{api}.STREAM.INFO.{kv}",
            f"{api}.DIRECT.GET.{kv}.{seq_subject}",
            seq_subject,
        ]},
        "subscribe": {"allow": [f"{inbox_prefix(p)}.>"]},
    }


def authorization_block(names: ClusterNames, *, producers: dict[str, str], trusted: dict[str, str]) -> str:
    """The servers' `authorization { users: [...] }` block: each producer (name -> password) held to
    its own results, each trusted user (nodes, the operator) with every right."""
    users = [{"user": p, "password": pw, "permissions": producer_permissions(names, p)} for p, pw in producers.items()]
    users += [{"user": u, "password": pw} for u, pw in trusted.items()]
    return "authorization {\n  users: " + json.dumps(users, indent=2) + "\n}"
