"""gRPC server reflection under both of its names: ``grpc.reflection.v1`` (what grpcurl and
the current clients ask first) and ``grpc.reflection.v1alpha`` (what older ones ask).

grpcio-reflection serves v1alpha only. The v1 service has the same messages, field for
field, under a new package, so the same servicer answers both: v1 calls are decoded and
encoded with v1alpha's message classes (the bytes are the same), and v1's file descriptor,
v1alpha's with its package renamed, joins the descriptor pool so that reflection can
describe the v1 service too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
_V1_PACKAGE = "grpc.reflection.v1"


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection on ``server`` as v1 and v1alpha, listing ``service_names`` and both
    reflection services."""
    _add_v1_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                V1_SERVICE_NAME, {"ServerReflectionInfo": v1_method}
            ),
        )
    )


def _add_v1_descriptor() -> None:
    """v1's file in the default descriptor pool (once): v1alpha's, renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = _V1_PACKAGE
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{_V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    proto.ClearField("options")  # v1alpha's Java and Go package names
    pool.Add(proto)
