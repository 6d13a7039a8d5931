"""Generated from jlora/api/protos/ by `make protos` (jlora/api/protoc.py)."""
