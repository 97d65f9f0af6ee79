"""The page plane: which pages this process knows, their data keys, their records in segment
files, their remote copies, and the page store that writes and reads their bytes on the tiers."""
