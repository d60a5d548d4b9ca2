"""Batch jobs: a JSONL file of prompts as one job with a status, live counts and a cancel.

Run in three processes: the user's `shmbroker submit --job` reads the file (`prompts`,
`openai_batch`, `text`) and writes the job's files (`store`) with a live display (`progress`); the
results process counts each job's results (`tally`); the scheduler fails back the items of a
cancelled job (`cancels`).
"""
