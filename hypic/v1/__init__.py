"""Generated protobuf/gRPC modules of the hypic.v1 wire contract (sources in protos/hypic/v1)."""
