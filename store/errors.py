"""The project's own exceptions: errors a user can cause, each with a message that says what to do."""


class FleetlensError(Exception):
    """Base for every error a user can cause. The CLI prints the message and exits with `exit_code`."""

    exit_code = 2


class ConfigError(FleetlensError):
    """A setting is missing or malformed (database URL, home folder, secret)."""


class DatabaseUnavailable(FleetlensError):
    """The database cannot be reached right now; callers that can wait (the agent) spool and retry."""


class SchemaError(FleetlensError):
    """The database schema is missing or at a revision this code does not know."""


class NotFound(FleetlensError):
    """A named thing (workflow, trace, device, action) is not in the store."""


class InvalidInput(FleetlensError):
    """A file or argument the user gave cannot be used (bad trace, malformed replay file, bad policy)."""


class UpstreamUnavailable(FleetlensError):
    """A telemetry server the user named (Prometheus) cannot be reached or does not answer as one."""


class DatabaseReadOnly(DatabaseUnavailable):
    """The database takes no writes right now (a read-only replica, or the server set read-only); writers keep
    their batches and try again, as through an outage."""


class PartitionMissing(DatabaseUnavailable):
    """No partition of a sample table takes a row's time (its day and the default partition are both missing);
    writers keep their batches until `fleetlens init` or the rollup job creates it."""


class DatabaseBusy(DatabaseUnavailable):
    """A concurrent writer, not an outage: PostgreSQL chose this transaction as a deadlock's victim or could not
    serialize it, or SQLite stayed locked past its busy timeout. Nothing of the transaction was written; writers keep
    their batches and try again."""


class DatabaseFull(DatabaseUnavailable):
    """The database's disk (or SQLite's page limit) is full; writers keep their batches until there is room."""


class UnsafeToRun(FleetlensError):
    """An agent refuses to start what it cannot verify: a relaunch spec that does not match its signature, or a
    checkpoint whose sha256 does not match the one recorded when it was written. Retrying cannot help."""
