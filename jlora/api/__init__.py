"""The versioned gRPC API (`jlora.v1`): messages, service stubs and the service's name.

The source is `protos/jlora/v1/jlora.proto`; the stubs in `gen/` are generated from it
by `make protos` and committed. Importing this package loads grpc and protobuf, never
jax, so the router and clients can use it on a small CPU box.

    from jlora.api import jlora_pb2 as pb, jlora_pb2_grpc as pb_grpc
    stub = pb_grpc.JloraStub(channel)
    for msg in stub.Generate(pb.GenerateRequest(text="Hi", adapter="my-lora")): ...
"""

from jlora.api.gen import jlora_pb2, jlora_pb2_grpc

SERVICE_NAME = jlora_pb2.DESCRIPTOR.services_by_name["Jlora"].full_name  # "jlora.v1.Jlora"

__all__ = ["SERVICE_NAME", "jlora_pb2", "jlora_pb2_grpc"]
