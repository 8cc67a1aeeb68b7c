"""Package hypic of the wire contract."""
