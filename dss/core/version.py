"""The version of dss (one place: the package, the CLI, the service and the client say it)."""

VERSION = "0.1.0"
