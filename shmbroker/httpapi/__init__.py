"""The OpenAI Files and Batches API over HTTP: a role of the broker (`[http]`) or `shmbroker serve-http`."""
