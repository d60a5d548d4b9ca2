"""Create or update the cluster's streams, key-value bucket and consumers (idempotent).

Coroutines on a `NatsLoop`'s loop (`loop.call(ensure_streams, loop.js, names, settings, ...)`).
The names are `subjects.ClusterNames`', the limits `subjects.StreamSettings`'. Both streams keep
work-queue retention (a message leaves when acked) in files, `discard: new` past `max_bytes`
(a full prompts stream is the producers' back-pressure) and a duplicate window for message ids.
The buckets have no TTL: the leases bucket holds the producers' sequence blocks, which must never
expire, and the payloads bucket the constraints' payloads, which an item redelivered late still names.
"""

from __future__ import annotations

from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from .subjects import ClusterNames, StreamSettings

STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"


def prompts_config(names: ClusterNames, settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=names.prompts_stream, subjects=[names.prompts_subjects], retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE, max_bytes=settings.prompts_max_bytes, discard=api.DiscardPolicy.NEW,
        num_replicas=settings.replicas, duplicate_window=settings.duplicate_window_seconds)


def results_config(names: ClusterNames, settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=names.results_stream, subjects=[names.results_subjects], retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE, max_bytes=settings.results_max_bytes, discard=api.DiscardPolicy.NEW,
        max_age=settings.results_max_age_seconds, num_replicas=settings.replicas,
        duplicate_window=settings.duplicate_window_seconds)


async def _create_or_update(js, config: api.StreamConfig, update: bool) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != STREAM_NAME_IN_USE:
            raise
        if update:
            await js.update_stream(config)


async def ensure_streams(js, names: ClusterNames, settings: StreamSettings, *, update: bool = True) -> None:
    """The prompts and results streams and the two buckets, created when missing; with `update` an
    existing stream takes `settings` (False: a producer creates what is missing, and leaves the
    operator's limits as they are)."""
    await _create_or_update(js, prompts_config(names, settings), update)
    await _create_or_update(js, results_config(names, settings), update)
    # the leases bucket takes direct gets: a read names its key in the request subject, so permissions
    # can hold a producer to its own `seq.<producer>` (permissions.py); the payloads bucket does not, so
    # that a node reads a payload from the stream's leader, never from a replica that lags its create
    await _ensure_bucket(js, names.leases_bucket, settings.replicas, direct=True)
    await _ensure_bucket(js, names.payloads_bucket, settings.replicas, direct=False)


async def _ensure_bucket(js, bucket: str, replicas: int, *, direct: bool) -> None:
    try:
        await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        await js.create_key_value(bucket=bucket, history=1, replicas=replicas, direct=direct,
                                  storage=api.StorageType.FILE)


def _consumer(name: str, filter_subject: str, ack_wait_seconds: float, max_ack_pending: int, replicas: int):
    """A durable pull consumer: explicit ack, every message from the start, no max_deliver."""
    return api.ConsumerConfig(durable_name=name, name=name, filter_subject=filter_subject, ack_policy=api.AckPolicy.EXPLICIT,
                              deliver_policy=api.DeliverPolicy.ALL, ack_wait=ack_wait_seconds,
                              max_ack_pending=max_ack_pending, max_deliver=-1, num_replicas=replicas)


async def ensure_partition_consumer(js, names: ClusterNames, settings: StreamSettings, partition: int) -> api.ConsumerInfo:
    """The durable pull consumer `part-<partition>` of the prompts stream."""
    config = _consumer(names.partition_consumer(partition), names.prompt_subject(partition), settings.ack_wait_seconds,
                       settings.max_ack_pending, settings.replicas)
    return await js.add_consumer(names.prompts_stream, config)


async def ensure_results_consumer(js, names: ClusterNames, settings: StreamSettings, producer: str) -> api.ConsumerInfo:
    """The durable pull consumer `res-<producer>` of the results stream."""
    config = _consumer(names.results_consumer(producer), names.result_subject(producer), settings.ack_wait_seconds,
                       settings.results_max_ack_pending, settings.replicas)
    return await js.add_consumer(names.results_stream, config)
