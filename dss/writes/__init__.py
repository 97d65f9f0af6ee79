"""Writes: the guard every store call holds, the writer that applies a change, compaction of
the disk tier, and the mover that carries out the policy's moves in the background."""
