"""What the router and the workers agree on; neither owns it, both import it.

- `errors`: the one request-error type (a status code, the field at fault, a message,
  a machine-readable reason), raised where the fault is found;
- `status`: that error as a gRPC status with rich details (`google.rpc.BadRequest`,
  `ErrorInfo`) and back, so it crosses every hop unchanged;
- `adapters`: an adapter's identity: the name rule, the path guard, the content hash;
- `registry`: the SQLite adapter registry both sides read;
- `auth`: the optional API key on every front door;
- `tool_calls`: the formats chat templates ask tool calls in, which a worker reports and
  the router parses;
- `grpc_server`: how both build their gRPC server (a port of their own, malformed
  requests answered INVALID_ARGUMENT, health, reflection v1alpha and v1);
- `signals`, `metrics`: the drain-on-signals helper and the latency histogram buckets.

Nothing here imports jax: the router runs on a small CPU box.
"""
