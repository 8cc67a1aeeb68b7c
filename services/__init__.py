"""The four gRPC services and the OpenAI-compatible front, each run as `python -m services.<name>`."""

import os

# grpc core (C code) prints its own log lines on stderr, plain text, outside Python's logging (so
# not as JSON): errors only unless the operator asks for more. It reads the variable when grpc is
# first imported, which in `python -m services.<name>` comes after this package.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
