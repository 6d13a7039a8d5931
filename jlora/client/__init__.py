"""A Python client of the jlora.v1 gRPC API, for a worker (`jlora serve`) or the router.

    from jlora.client import Client, NotFound

    with Client("127.0.0.1:50051", api_key="KEY", timeout=30) as client:
        done = client.generate("Hello", adapter="sql-lora", max_tokens=16, temperature=0)
        print(done.text, done.finish_reason, done.usage.completion_tokens)
        for response in client.stream([1, 2, 3], max_tokens=8, logprobs=2):
            print(response.token_id, response.text, response.logprobs.token.logprob)
        client.register_adapter("org/c-lora:v2", "c-lora", load=True)

`AsyncClient` has the same methods as coroutines (`stream`: an async iterator). Sampling
fields are SamplingParams' own names, passed through as given. A failed call raises the
`JloraError` subclass of its status code, with the server's `field`, `reason` and
`message` (`errors.py`). Importing this package loads grpc and protobuf, never jax.
"""

from jlora.client.aio import AsyncClient
from jlora.client.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    JloraError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
)
from jlora.client.messages import Completion, generate_request, sampling_params
from jlora.client.sync import Client

__all__ = [
    "Aborted",
    "AlreadyExists",
    "AsyncClient",
    "Cancelled",
    "Client",
    "Completion",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "JloraError",
    "NotFound",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "error_from_rpc",
    "generate_request",
    "sampling_params",
]
