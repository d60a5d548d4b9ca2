"""Batch jobs: a JSONL file of prompts as one job with a status, live counts and a cancel (`store`),
counted by the results process (`tally`) and cancelled by the scheduler (`cancels`)."""
