"""Generated gRPC stubs for serving/proto/pagedjax.proto (see regen.sh)."""
