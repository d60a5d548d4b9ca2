"""The configuration: `shmbroker.toml` into frozen dataclasses, validated in one place.

`settings` holds every key with its default and its check; `validator` makes each refusal a
`ConfigError` naming the file and the key; `defaults` holds the defaults that processes read
without a configuration. Read by the supervisor and the commands; no process reads TOML itself.
"""
