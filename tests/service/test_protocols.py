"""What a client written elsewhere meets: reflection v1 and v1alpha with the proto's comments, grpc.health.v1
Check/List/Watch (also on the probe-only health port), JSON over HTTP and 415 for other content types."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pb2, json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import codec
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.transport.reflection import V1, V1ALPHA
from testkit.harness import FAST_START, ServiceProcess, metric_total, scrape
from testkit.payloads import big_answer_build_chunk
from tests.golden import GOLDEN, chunk_inputs, metadata_as_dict


def reflect(address: str, service: str, request: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
    with grpc.insecure_channel(address) as channel:
        info = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        (response,) = list(info(iter([request]), timeout=10))
    return response


def test_grpcios_reflection_client_asks_question_after_question_on_one_connection(live_server: ServiceProcess) -> None:
    """grpcio's reflection client opens a stream per question, the next as soon as it has the last answer, before the
    server has released the last one's slot: the per-connection cap must leave room for that (with a cap of 1, 10 of
    100 of these rounds were refused RESOURCE_EXHAUSTED, a fresh-clone CI run among them)."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for _ in range(40):
        with grpc.insecure_channel(live_server.address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            assert SERVICE_NAME in set(database.get_services())
            assert DescriptorPool(database).FindServiceByName(SERVICE_NAME).methods


@pytest.mark.parametrize("service", [V1, V1ALPHA], ids=["v1", "v1alpha"])
def test_reflection_lists_services_and_sends_descriptors_with_comments(live_server: ServiceProcess, service) -> None:
    listed = reflect(live_server.address, service, rpb.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health", V1, V1ALPHA} <= names
    found = reflect(live_server.address, service, rpb.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME))
    (raw,) = found.file_descriptor_response.file_descriptor_proto
    file = descriptor_pb2.FileDescriptorProto.FromString(raw)
    assert file.name == "indexer/v1/indexer.proto" and file.options.go_package
    comments = " ".join(loc.leading_comments for loc in file.source_code_info.location)
    assert "little-endian int32" in comments


def test_reflection_names_what_it_does_not_know(live_server: ServiceProcess) -> None:
    missing = reflect(live_server.address, V1, rpb.ServerReflectionRequest(file_containing_symbol="no.Such"))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "no.Such" in missing.error_response.error_message


def health_stub(address: str) -> tuple[grpc.Channel, health_pb2_grpc.HealthStub]:
    channel = grpc.insecure_channel(address)
    return channel, health_pb2_grpc.HealthStub(channel)


@pytest.mark.parametrize("port", ["grpc_port", "health_port"])
def test_health_check_list_and_not_found_on_both_ports(live_server: ServiceProcess, port: str) -> None:
    channel, health = health_stub(f"127.0.0.1:{live_server.ports[port]}")
    with channel:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == serving
        listed = health.List(health_pb2.HealthListRequest(), timeout=5)
        assert {name: s.status for name, s in listed.statuses.items()} == {"": serving, SERVICE_NAME: serving}
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
        assert "'no.Such'" in unknown.value.details() and SERVICE_NAME in unknown.value.details()
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert next(watch).status == serving
        watch.cancel()


def test_the_health_port_serves_nothing_but_health(live_server: ServiceProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{live_server.ports['health_port']}") as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/GetWarmupStatus")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"", timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED


def post(url: str, body: bytes, content_type: str) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, data=body, headers={"content-type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["content-type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["content-type"], exc.read()


def test_json_over_http_uses_the_proto3_json_mapping(live_server: ServiceProcess) -> None:
    case = next(c for c in GOLDEN["chunk_metadata"] if c["name"].startswith("E1"))
    inputs = chunk_inputs(case)
    request = json_format.MessageToJson(codec.chunk_inputs_to_proto(inputs))
    status, content_type, body = post(
        f"{live_server.http_rpc_url}/{SERVICE_NAME}/BuildChunk", request.encode(), "application/json; charset=utf-8"
    )
    assert status == 200 and content_type == "application/json"
    answer = json_format.Parse(body, pb.BuildChunkResponse())
    assert metadata_as_dict(codec.metadata_from_proto(answer.metadata)) == case["expected"]
    # bytes fields are base64 in the JSON mapping
    assert json.loads(request)["queryStartLoc"]


def test_a_json_answer_is_admitted_for_what_its_encoding_holds() -> None:
    """A JSON answer holds 5 bytes per protobuf answer byte at its peak (http_app.JSON_HELD_PER_ANSWER_BYTE): with
    a budget of three times the answer, protobuf is served and JSON is refused before any work, as a request
    above a limit (work_limit: no wait could make room for it)."""
    request = big_answer_build_chunk(1 << 20)
    budget = str(3 << 20)
    with ServiceProcess(*FAST_START, "--response-budget-bytes", budget, "--admission-wait-seconds", "0.1") as server:
        url = f"{server.http_rpc_url}/{SERVICE_NAME}/BuildChunk"
        status, _, body = post(url, request.SerializeToString(), "application/x-protobuf")
        assert status == 200 and len(body) > 1_000_000
        status, _, body = post(url, json_format.MessageToJson(request).encode(), "application/json")
        message = json.loads(body)["message"]
        assert status == 429 and "response_budget_bytes" in message and "send application/x-protobuf" in message
        shed = metric_total(scrape(server.http_url), "indexer_requests_shed_total", reason="work_limit")
        assert shed == 1 and metric_total(scrape(server.http_url), "indexer_response_bytes_held") == 0


def test_json_errors_and_other_content_types(live_server: ServiceProcess) -> None:
    url = f"{live_server.http_rpc_url}/{SERVICE_NAME}/BuildChunk"
    status, _, body = post(url, b'{"queryStartLoc": 5}', "application/json")
    assert status == 400 and json.loads(body)["code"] == "INVALID_ARGUMENT"
    assert json.loads(body)["message"].startswith("bytes field `query_start_loc` must be a base64 string")
    status, _, body = post(url, b"query_start_loc=0", "text/plain")
    assert status == 415 and b"application/x-protobuf" in body and b"application/json" in body


def test_an_empty_answer_over_http_leaves_the_connection_reusable(live_server: ServiceProcess) -> None:
    """A request whose chunk holds no token answers an empty message: it must still end its response."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", live_server.http_rpc_port, timeout=10)
    empty = pb.BuildChunkRequest(query_start_loc=codec.encode_int32([0])).SerializeToString()
    try:
        for _ in range(3):
            connection.request("POST", f"/{SERVICE_NAME}/BuildChunk", body=empty)
            reply = connection.getresponse()
            assert (reply.status, reply.read()) == (200, b"")
    finally:
        connection.close()
