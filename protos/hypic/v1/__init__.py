"""Generated protobuf/gRPC modules of hypic.v1 (regenerate with `python protos/generate.py`)."""
