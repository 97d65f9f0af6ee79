"""Erasure: what forgetting a user says (plan, job states, receipt) and the job that does it."""
