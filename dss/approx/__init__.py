"""Approximate matching: the MinHash-LSH index of stored versions, kept current from the same
events as the mirror, and the near-duplicate search verified token by token."""
