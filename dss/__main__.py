"""``python -m dss``: the command line."""

from dss.cli.main import main

main()
