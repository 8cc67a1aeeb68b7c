"""The hypic wire contract: .proto sources and their generated Python modules (protos/generate.py)."""
