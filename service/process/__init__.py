"""The serving process and its lifecycle: start-up, signals, the supervisor of worker processes and its protocol,
listeners, the CLI."""
