"""Sessions: the token trie, a session's state, the writes that build versions, this process's
mirror of the catalog, and matching a prompt exactly (what ``resume`` answers)."""
