"""`shmbroker results`: write the results a producer name has not read yet as JSONL."""

from __future__ import annotations

from collections import Counter

from .common import ResultSink, _data_dir, _err, _load_ids, _open_producer, _output, _result_row, _written_ids


def results(args) -> int:
    from ..errors import BrokerError

    data_dir = _data_dir(args)
    if data_dir is None:
        return 2
    ids = _load_ids(data_dir, args.name)
    try:
        producer = _open_producer(args, args.name, data_dir)
    except (BrokerError, OSError, ValueError) as exc:
        _err(str(exc))
        return 1
    count = 0
    statuses: Counter[str] = Counter()
    try:
        with producer, _output(args.out) as out:
            sink = ResultSink(out, producer, _written_ids(args.out))
            for r in producer.results(timeout_seconds=max(0.0, args.timeout), auto_ack=False):
                if sink.write(r.item_id, _result_row(r, ids)):
                    statuses[r.status] += 1
                    count += 1
            sink.commit()
    except BrokerError as exc:
        _err(f"{exc} (after {count} results)")
        return 1
    except OSError as exc:  # the --out file
        _err(f"{exc} (after {count} results)")
        return 2 if count == 0 else 1
    except KeyboardInterrupt:
        _err(f"interrupted after {count} results")
        return 130
    counts = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
    where = f" to {args.out}" if args.out else ""
    _err(f"{count} results for producer {args.name!r}" + (f" ({counts})" if counts else "") + f" written{where}")
    return 0
