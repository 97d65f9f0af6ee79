"""Placement: what the policy remembers of pages and users, and what it decides (victims,
admissions, moves) from those values."""
