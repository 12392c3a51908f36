"""Unit tests of dsa_client.CoordinatorClient against an in-process fake coordinator (a gRPC server
on a free loopback port): the requests it builds, the events it streams, abort, GetLoad, health,
and TLS credentials passed through."""

import asyncio
import os
import sys
import threading
import unittest
from concurrent import futures

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsa_client import (DEFAULT_GENERATE_TIMEOUT_S, AsyncCoordinatorClient,  # noqa: E402
                        CoordinatorClient, Overrides, Sampling)
from dsa_client.client import (HEALTH_CHECK_METHOD, HealthCheckRequest,  # noqa: E402
                               HealthCheckResponse)
from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Streams Admitted, max_new_tokens Tokens and Finished; a request with max_new_tokens above
    1000 waits until aborted and then ends with CANCELLED. A context_tokens request is a real
    model's: each Tokens event carries the id 100 + its position, and Finished says
    FINISH_REASON_LENGTH."""

    def __init__(self):
        self.requests = []
        self.time_remaining = None  # the last Generate's deadline, seconds from its start
        self.aborts = {}  # request id -> threading.Event
        self.ended = {}  # request id -> threading.Event, set when its call ends (cancel included)
        self.lock = threading.Lock()

    def Generate(self, request, context):
        self.requests.append(request)
        self.time_remaining = context.time_remaining()
        aborted, ended = threading.Event(), threading.Event()
        context.add_callback(ended.set)
        with self.lock:
            self.aborts[request.request_id] = aborted
            self.ended[request.request_id] = ended
        yield coordinator_pb2.GenerateEvent(admitted=coordinator_pb2.Admitted(
            indexer_worker="indexer-0", attention_worker="attention-0"))
        real = request.WhichOneof("context") == "context_tokens"
        if request.max_new_tokens > 1000:
            yield coordinator_pb2.GenerateEvent(tokens=coordinator_pb2.Tokens(
                count=1, token_ids=[100] if real else []))
            # Until aborted, or the client goes away (its cancel), for 10 s at most.
            for _ in range(1000):
                if aborted.wait(timeout=0.01) or not context.is_active():
                    break
            context.abort(grpc.StatusCode.CANCELLED, "aborted")
        for position in range(request.max_new_tokens):
            yield coordinator_pb2.GenerateEvent(tokens=coordinator_pb2.Tokens(
                first_position=position, count=1, token_ids=[100 + position] if real else []))
        yield coordinator_pb2.GenerateEvent(finished=coordinator_pb2.Finished(
            generated_tokens=request.max_new_tokens,
            finish_reason=coordinator_pb2.FINISH_REASON_LENGTH))

    def Abort(self, request, context):
        with self.lock:
            aborted = self.aborts.get(request.request_id)
        if aborted is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id}")
        aborted.set()
        return coordinator_pb2.AbortResponse()

    def GetLoad(self, request, context):
        return coordinator_pb2.GetLoadResponse(
            queued=2, running=3, cache_blocks_used=10, cache_blocks_capacity=100,
            indexer_workers=[coordinator_pb2.WorkerLoad(address="indexer-0", sequences=3)])


def _health_handler(statuses):
    def check(request, context):
        if request.service not in statuses:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return HealthCheckResponse(status=statuses[request.service])

    _, service, method = HEALTH_CHECK_METHOD.split("/")
    handler = grpc.unary_unary_rpc_method_handler(
        check, request_deserializer=HealthCheckRequest.FromString,
        response_serializer=HealthCheckResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(service, {method: handler})


class FakeServerCase(unittest.TestCase):
    """A FakeCoordinator with the health service on a free loopback port, and a client of it."""

    def setUp(self):
        self.fake = FakeCoordinator()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(self.fake, self.server)
        self.server.add_generic_rpc_handlers(
            [_health_handler({"liveness": 1, "readiness": 2, "": 2})])
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.port = port
        self.server.start()
        self.client = CoordinatorClient.connect(f"127.0.0.1:{port}")

    def tearDown(self):
        self.client.close()
        self.server.stop(grace=None)


class CoordinatorClientTest(FakeServerCase):

    def test_generate_streams_admitted_tokens_finished(self):
        events = list(self.client.generate("r1", context_length=4096, max_new_tokens=3))
        kinds = [event.WhichOneof("event") for event in events]
        self.assertEqual(kinds, ["admitted", "tokens", "tokens", "tokens", "finished"])
        self.assertEqual(events[0].admitted.indexer_worker, "indexer-0")
        self.assertEqual(events[-1].finished.generated_tokens, 3)

    def test_generate_builds_the_request(self):
        list(self.client.generate(
            "r2", context_tokens=[5, 6, 7], max_new_tokens=1, prefix_block_ids=[11, 12],
            draft_length=2, session_id="s", overrides=Overrides(top_k=64, all_keep=True)))
        request = self.fake.requests[-1]
        self.assertEqual(request.request_id, "r2")
        self.assertEqual(request.WhichOneof("context"), "context_tokens")
        self.assertEqual(list(request.context_tokens.tokens), [5, 6, 7])
        self.assertEqual(list(request.prefix_block_ids), [11, 12])
        self.assertEqual((request.draft_length, request.session_id), (2, "s"))
        self.assertEqual(request.overrides.top_k, 64)
        self.assertTrue(request.overrides.all_keep)
        # Unset overrides stay unset (the deployment's defaults apply).
        self.assertFalse(request.overrides.HasField("target_block_sparsity"))
        self.assertFalse(request.overrides.HasField("acceptance_rate"))

    def test_generate_builds_a_real_models_request(self):
        list(self.client.generate(
            "r4", context_tokens=[504, 3575], max_new_tokens=2,
            sampling=Sampling(temperature=0.7, top_p=0.9, seed=5), stop_token_ids=[2, 13],
            ignore_eos=True))
        request = self.fake.requests[-1]
        self.assertAlmostEqual(request.sampling.temperature, 0.7, places=6)
        self.assertAlmostEqual(request.sampling.top_p, 0.9, places=6)
        self.assertEqual(request.sampling.seed, 5)
        self.assertEqual(list(request.stop_token_ids), [2, 13])
        self.assertTrue(request.ignore_eos)
        # Defaults: greedy (no sampling message), no stop ids, ends at EOS.
        list(self.client.generate("r5", context_tokens=[1], max_new_tokens=1))
        request = self.fake.requests[-1]
        self.assertFalse(request.HasField("sampling"))
        self.assertEqual(list(request.stop_token_ids), [])
        self.assertFalse(request.ignore_eos)

    def test_an_unseeded_sampling_leaves_the_seed_to_the_coordinator(self):
        list(self.client.generate("r6", context_tokens=[1], max_new_tokens=1,
                                  sampling=Sampling(temperature=0.7)))
        self.assertFalse(self.fake.requests[-1].sampling.HasField("seed"))
        # Seed 0 is a seed like any other, sent as such.
        list(self.client.generate("r7", context_tokens=[1], max_new_tokens=1,
                                  sampling=Sampling(temperature=0.7, seed=0)))
        sampling = self.fake.requests[-1].sampling
        self.assertTrue(sampling.HasField("seed"))
        self.assertEqual(sampling.seed, 0)

    def test_token_ids_stream_and_keep_the_finished_event(self):
        generation = self.client.generate("r6", context_tokens=[7, 8, 9], max_new_tokens=4)
        self.assertEqual(list(generation.token_ids()), [100, 101, 102, 103])
        self.assertEqual(generation.admitted.indexer_worker, "indexer-0")
        self.assertEqual(generation.finished.generated_tokens, 4)
        self.assertEqual(generation.finished.finish_reason,
                         coordinator_pb2.FINISH_REASON_LENGTH)
        # The pattern model's events carry no ids.
        generation = self.client.generate("r7", context_length=16, max_new_tokens=3)
        self.assertEqual(list(generation.token_ids()), [])
        self.assertEqual(generation.finished.generated_tokens, 3)

    def test_leaving_token_ids_early_cancels_the_call(self):
        # The fake holds these calls 10 s unless cancelled: each must end within 5.
        generation = self.client.generate("early", context_tokens=[1], max_new_tokens=5000)
        for _ in generation.token_ids():
            break
        self.assertTrue(self.fake.ended["early"].wait(5))
        self.assertEqual(generation.code(), grpc.StatusCode.CANCELLED)
        # The with block's exit cancels, while its iterator is still alive (so not its finally).
        with self.client.generate("block", context_tokens=[1], max_new_tokens=5000) as g:
            ids = g.token_ids()
            next(ids)
        self.assertTrue(self.fake.ended["block"].wait(5))
        self.assertEqual(g.code(), grpc.StatusCode.CANCELLED)
        del ids

    def test_generate_needs_exactly_one_context(self):
        with self.assertRaises(ValueError):
            self.client.generate("r3", max_new_tokens=1)
        with self.assertRaises(ValueError):
            self.client.generate("r3", context_length=1, context_tokens=[1], max_new_tokens=1)

    def test_abort_ends_the_stream_with_cancelled(self):
        generation = self.client.generate("long", context_length=16, max_new_tokens=5000)
        events = iter(generation)
        self.assertEqual(next(events).WhichOneof("event"), "admitted")
        self.assertEqual(next(events).WhichOneof("event"), "tokens")
        self.client.abort("long")
        with self.assertRaises(grpc.RpcError) as raised:
            list(events)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.CANCELLED)
        self.assertEqual(generation.code(), grpc.StatusCode.CANCELLED)

    def test_abort_of_an_unknown_request_is_not_found(self):
        with self.assertRaises(grpc.RpcError) as raised:
            self.client.abort("nobody")
        self.assertEqual(raised.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_get_load(self):
        load = self.client.get_load()
        self.assertEqual((load.queued, load.running), (2, 3))
        self.assertEqual((load.cache_blocks_used, load.cache_blocks_capacity), (10, 100))
        self.assertEqual([w.address for w in load.indexer_workers], ["indexer-0"])

    def test_health_names(self):
        self.assertEqual(self.client.health("liveness"), "SERVING")
        self.assertEqual(self.client.health("readiness"), "NOT_SERVING")
        self.assertEqual(self.client.health(""), "NOT_SERVING")
        with self.assertRaises(grpc.RpcError) as raised:
            self.client.health("nope")
        self.assertEqual(raised.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_health_of_an_unreachable_server_raises(self):
        self.server.stop(grace=None)
        with self.assertRaises(grpc.RpcError) as raised:
            self.client.health("liveness", timeout_s=0.5)
        self.assertIn(raised.exception.code(),
                      (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))


class DeadlineTest(FakeServerCase):
    def test_generate_has_a_default_deadline_and_none_on_request(self):
        list(self.client.generate("d1", context_length=16, max_new_tokens=1))
        self.assertGreater(self.fake.time_remaining, DEFAULT_GENERATE_TIMEOUT_S - 60)
        # gRPC sends the deadline as a timeout rounded up to its unit: up to a second over.
        self.assertLessEqual(self.fake.time_remaining, DEFAULT_GENERATE_TIMEOUT_S + 2)
        list(self.client.generate("d2", context_length=16, max_new_tokens=1, timeout_s=None))
        self.assertGreater(self.fake.time_remaining, 1e9)  # gRPC's "no deadline"


class AsyncCoordinatorClientTest(FakeServerCase):
    """AsyncCoordinatorClient (grpc.aio) against the same fake: the same events, abort, GetLoad
    and health, each awaited."""

    def run_async(self, body):
        async def run():
            async with AsyncCoordinatorClient.connect(self.target) as client:
                return await body(client)
        return asyncio.run(run())

    def setUp(self):
        super().setUp()
        self.target = f"127.0.0.1:{self.port}"

    def test_async_generate_streams_and_token_ids_keep_finished(self):
        async def body(client):
            kinds = [e.WhichOneof("event") async for e in client.generate(
                "a1", context_length=64, max_new_tokens=2)]
            generation = client.generate("a2", context_tokens=[1, 2], max_new_tokens=3)
            ids = [t async for t in generation.token_ids()]
            return kinds, ids, generation.finished
        kinds, ids, finished = self.run_async(body)
        self.assertEqual(kinds, ["admitted", "tokens", "tokens", "finished"])
        self.assertEqual(ids, [100, 101, 102])
        self.assertEqual(finished.finish_reason, coordinator_pb2.FINISH_REASON_LENGTH)

    def test_leaving_token_ids_early_cancels_the_call(self):
        # The fake holds these calls 10 s unless cancelled: each must end within 5.
        async def body(client):
            results = []
            generation = client.generate("early", context_tokens=[1], max_new_tokens=5000)
            async for _ in generation.token_ids():
                break
            # asyncio finalizes the dropped generator, which cancels the call.
            results.append(await asyncio.to_thread(self.fake.ended["early"].wait, 5))
            results.append(await generation.code())
            # The block's exit cancels, while its iterator is still alive (so not its finally).
            async with client.generate("block", context_tokens=[1], max_new_tokens=5000) as g:
                ids = g.token_ids()
                await ids.__anext__()
            results.append(await asyncio.to_thread(self.fake.ended["block"].wait, 5))
            results.append(await g.code())
            await ids.aclose()
            return results
        self.assertEqual(self.run_async(body), [True, grpc.StatusCode.CANCELLED] * 2)

    def test_async_abort_get_load_and_health(self):
        async def body(client):
            generation = client.generate("long", context_length=16, max_new_tokens=5000)
            events = generation.__aiter__()
            first = await events.__anext__()
            await events.__anext__()
            await client.abort("long")
            with self.assertRaises(grpc.aio.AioRpcError) as raised:
                async for _ in events:
                    pass
            with self.assertRaises(grpc.aio.AioRpcError) as unknown:
                await client.abort("nobody")
            return (first.WhichOneof("event"), raised.exception.code(), unknown.exception.code(),
                    (await client.get_load()).queued, await client.health("liveness"),
                    await client.health("readiness"))
        self.assertEqual(self.run_async(body),
                         ("admitted", grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND, 2,
                          "SERVING", "NOT_SERVING"))


class ConnectTest(unittest.TestCase):
    def test_tls_arguments_make_a_secure_channel(self):
        made = {}
        original_ssl, original_secure = grpc.ssl_channel_credentials, grpc.secure_channel

        def fake_ssl(**kwargs):
            made["ssl"] = kwargs
            return original_ssl()

        def fake_secure(target, credentials, options=None):
            made["secure"] = target
            return original_secure(target, credentials, options=options)

        grpc.ssl_channel_credentials, grpc.secure_channel = fake_ssl, fake_secure
        try:
            CoordinatorClient.connect("localhost:1", root_certificates=b"ca").close()
        finally:
            grpc.ssl_channel_credentials, grpc.secure_channel = original_ssl, original_secure
        self.assertEqual(made["ssl"], {"root_certificates": b"ca", "private_key": None,
                                       "certificate_chain": None})
        self.assertEqual(made["secure"], "localhost:1")


if __name__ == "__main__":
    unittest.main()
