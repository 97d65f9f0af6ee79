"""``python -m dss``: the command line."""

from dss.cli import main

main()
