"""`shmbroker results`: write the results a producer name has not read yet as JSONL (a job's also in the
OpenAI Batch output format, keyed by custom_id, as `submit --job --wait` writes them)."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack

from .common import ResultSink, config_data_dir, load_entries, load_ids, open_output, open_producer, print_error, result_row, written_ids


def results(args) -> int:
    from ..errors import BrokerError
    from ..jobs import store
    from ..jobs.store import job_dir
    from .jobrun import open_tokenizer
    from .jobsink import JobSink, error_path, written_keys

    data_dir = config_data_dir(args)
    if data_dir is None:
        return 2
    # (a caller may build args without the job options: bench/chaos_score.py does)
    fmt, tokenizer_at, error_file = (getattr(args, k, None) for k in ("out_format", "tokenizer", "error_file"))
    fmt = fmt or "native"
    as_job = fmt != "native" or tokenizer_at or error_file
    if as_job and (getattr(args, "cluster", None) or not store.is_job(data_dir, args.name)):
        print_error(f"--out-format, --error-file and --tokenizer are a job's: {args.name!r} is no job in {data_dir}")
        return 2
    if error_file and fmt != "openai":
        print_error("--error-file goes with --out-format openai (the native format keeps errors in its rows)")
        return 2
    tokenizer, code = open_tokenizer(tokenizer_at, data_dir if as_job else None)
    if code:
        return code
    entries = load_entries(data_dir, args.name) if as_job else None
    ids = None if as_job else load_ids(data_dir, args.name)
    errors_at = (error_file or error_path(args.out)) if fmt == "openai" and args.out else None
    try:
        producer = open_producer(args, args.name, data_dir)
    except (BrokerError, OSError, ValueError) as exc:
        print_error(str(exc))
        return 1
    count = 0
    statuses: Counter[str] = Counter()
    try:
        with producer, open_output(args.out) as out, ExitStack() as files:
            if as_job:
                errors = files.enter_context(open_output(errors_at)) if errors_at else None
                sink = JobSink(out, errors, producer, fmt, tokenizer, written_keys(args.out, errors_at),
                               job_dir(data_dir, args.name))
                files.callback(sink.close)
                sink.write_whole(entries.values())

                def write(r) -> bool:
                    return sink.result(r, entries.get(r.item_id))
            else:
                sink = ResultSink(out, producer, written_ids(args.out))

                def write(r) -> bool:
                    return sink.write(r.item_id, result_row(r, ids))
            for r in producer.results(timeout_seconds=max(0.0, args.timeout), auto_ack=False):
                if write(r):
                    statuses[r.status] += 1
                    count += 1
            sink.commit()
    except BrokerError as exc:
        print_error(f"{exc} (after {count} results)")
        return 1
    except OSError as exc:  # the --out file
        print_error(f"{exc} (after {count} results)")
        return 2 if count == 0 else 1
    except KeyboardInterrupt:
        print_error(f"interrupted after {count} results")
        return 130
    counts = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
    where = f" to {args.out}" if args.out else ""
    print_error(f"{count} results for producer {args.name!r}" + (f" ({counts})" if counts else "") + f" written{where}")
    return 0
