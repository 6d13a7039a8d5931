"""The worker server: the `jlora.v1` gRPC service around one engine.

    server = serve(engine, port=50051, metrics_port=9090, tokenizer=tokenizer)
    server.stop_on_signals(grace=30)   # SIGTERM/SIGINT drain
    server.wait()
    engine.close()

`app.py` builds the server and tells how it stops; `servicer.py` tells a Generate
call's life; `scheduler.py` the engine's thread; `metrics.py` lists the metrics and
`logs.py` the log lines about the traffic; `convert.py` maps the wire's messages to the
engine's types.
"""

from jlora.server.app import WorkerServer, serve

__all__ = ["WorkerServer", "serve"]
