"""The configuration: `shmbroker.toml` into frozen dataclasses, validated in one place.

`broker` declares every top-level key as a field (its default, its help, its check); the engines'
and the cluster's keys are declared by their own dataclasses (engines/options.py,
cluster/options.py), which import nothing from here. `settings` reads a file (`load`, `parse`);
`engines` and `cluster` read the `engine_settings` and `[cluster]` tables; `validator` makes each
refusal a `ConfigError` naming the file and the key; `reference` writes docs/configuration.md from
the fields. Read by the supervisor and the commands; no process reads TOML itself.
"""
