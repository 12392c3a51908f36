// Tests of the gRPC adapter's answers to bad input (grpc_service_fixture.h): the precise status
// while the server keeps serving, a chunk over the limit, a failed select in a stream, K above the
// backend's largest, an answer that could pass the message limit, unparseable messages, and a
// failed multi-chunk append or a failed request with new index keys leaving nothing behind.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/indexer_service/grpc_service_fixture.h"
#include "tests/testing/raw_call.h"

namespace dsa {
namespace {

using namespace ::dsa::grpc_service_testing;  // NOLINT(google-build-using-namespace)

TEST_F(GrpcServiceTest, BadInputGetsThePreciseStatusAndTheServerKeepsServing) {
  StartServer(8);  // 512 slots in all
  std::mt19937 rng(5);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 100 * kD), 40);
  const v1::GetLoadResponse before = Load();

  // Duplicate: ALREADY_EXISTS with the engine's own message.
  const grpc::Status duplicate = Create(CreateRequest(1, 1, 0.4));
  EXPECT_EQ(duplicate.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(duplicate.error_message(), twin_->CreateSequence(1, EngineOptions(1, 0.4)).message());
  // Bad settings and unknown enum values: INVALID_ARGUMENT.
  v1::CreateSequenceRequest bad_create = CreateRequest(2, 1, 1.5);
  EXPECT_EQ(Create(bad_create).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_create = CreateRequest(2, 1, 0.4);
  bad_create.mutable_spin()->set_pooling(static_cast<v1::BlockPooling>(42));
  EXPECT_EQ(Create(bad_create).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_create = CreateRequest(2, 0, 0.4);
  EXPECT_EQ(Create(bad_create).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Unknown sequence: NOT_FOUND from every RPC.
  EXPECT_EQ(Append({{99, 0, 0, RandomValues(rng, kD)}}).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Commit(99, 0).error_code(), grpc::StatusCode::NOT_FOUND);
  {
    v1::SelectRequest request;
    AddGroup(&request, 99, 0, 0, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
    v1::SelectResponse response;
    EXPECT_EQ(Select(request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
    grpc::ClientContext context;
    v1::ReleaseRequest release;
    release.set_sequence_id(99);
    v1::ReleaseResponse released;
    EXPECT_EQ(stub_->Release(&context, release, &released).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }

  // Queries of the wrong dtype or shape, head weights not fp32, NaN in a query, no groups,
  // a row whose key is not appended yet.
  auto select_status = [&](const v1::SelectRequest& request) {
    v1::SelectResponse response;
    return Select(request, &response).error_code();
  };
  {
    Rows rows = MakeRows(rng, 1, common::v1::DTYPE_FLOAT32);
    v1::SelectRequest request;
    AddGroup(&request, 1, 0, 99, rows);
    request.mutable_groups(0)->mutable_queries()->set_dtype(common::v1::DTYPE_INT32);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);
    request.mutable_groups(0)->mutable_queries()->set_dtype(common::v1::DTYPE_UNSPECIFIED);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    const Rows wide = [&] {
      Rows r;
      r.queries = RandomValues(rng, kH * (kD + 1));
      EncodeFloatTensor(r.queries, std::vector<int64_t>{1, kH, kD + 1}, &r.query_tensor);
      r.weight_tensor = rows.weight_tensor;
      return r;
    }();
    request.Clear();
    AddGroup(&request, 1, 0, 99, wide);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    AddGroup(&request, 1, 0, 99, rows);
    request.mutable_groups(0)->mutable_queries()->mutable_data()->resize(kH * kD * 4 - 1);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    AddGroup(&request, 1, 0, 99, rows);
    request.mutable_groups(0)->mutable_head_weights()->set_dtype(common::v1::DTYPE_BFLOAT16);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    Rows nan_rows = rows;
    nan_rows.queries[5] = std::numeric_limits<float>::quiet_NaN();
    EncodeFloatTensor(nan_rows.queries, std::vector<int64_t>{1, kH, kD}, &nan_rows.query_tensor);
    request.Clear();
    AddGroup(&request, 1, 0, 99, nan_rows);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    request.Clear();
    AddGroup(&request, 1, 0, 100, rows);
    EXPECT_EQ(select_status(request), grpc::StatusCode::OUT_OF_RANGE);
    request.Clear();
    AddGroup(&request, 1, 3, 99, rows);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);

    // A good group followed by a bad one: the bad one is caught before the good one runs.
    request.Clear();
    AddGroup(&request, 1, 0, 99, rows);
    AddGroup(&request, 1, 0, 99, wide);
    EXPECT_EQ(select_status(request), grpc::StatusCode::INVALID_ARGUMENT);
    // Commit with nothing pending: FAILED_PRECONDITION.
    EXPECT_EQ(Commit(1, 0).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }

  // NaN in the second chunk of an append: INVALID_ARGUMENT and the first chunk is undone.
  {
    std::vector<float> nan_keys = RandomValues(rng, 10 * kD);
    nan_keys[3 * kD + 1] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(Append({{1, 0, 100, RandomValues(rng, 10 * kD)}, {1, 0, 110, nan_keys}}).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(*indexer_->NumSlots(1, 0), 100);
    // A wrong first_slot: FAILED_PRECONDITION; a key of the wrong width: INVALID_ARGUMENT.
    EXPECT_EQ(Append({{1, 0, 101, RandomValues(rng, kD)}}).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    {
      grpc::ClientContext context;
      v1::AppendIndexKeysResponse response;
      auto writer = stub_->AppendIndexKeys(&context, &response);
      v1::AppendIndexKeysRequest request;
      request.set_sequence_id(1);
      request.set_first_slot(100);
      EncodeFloatTensor(RandomValues(rng, 2 * (kD + 1)), std::vector<int64_t>{2, kD + 1},
                        request.mutable_keys());
      writer->Write(request);
      writer->WritesDone();
      EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    }
  }

  // A context beyond capacity: the third chunk does not fit; the two before it are undone.
  EXPECT_EQ(Append({{1, 0, 100, RandomValues(rng, 200 * kD)},
                    {1, 0, 300, RandomValues(rng, 200 * kD)},
                    {1, 0, 500, RandomValues(rng, 200 * kD)}})
                .error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 100);
  const v1::GetLoadResponse after = Load();
  EXPECT_EQ(after.used_blocks(), before.used_blocks());
  EXPECT_EQ(after.free_blocks(), before.free_blocks());
  EXPECT_EQ(after.sequences(), 1);

  // The server keeps serving, and the state equals the twin that never saw the bad requests.
  AppendBoth(1, 0, RandomValues(rng, 300 * kD), 120);
  ExpectOneRowSelectMatchesTwin(rng, common::v1::DTYPE_FLOAT8_E4M3FN, 1, 0, 399);
}

TEST_F(GrpcServiceTest, AChunkOverTheLimitIsRefusedAndNothingIsWritten) {
  StartServer(64);
  std::mt19937 rng(11);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 70 * kD), 70);
  // One good chunk, then one of 5 MiB (over the 4 MiB chunk limit): refused, the first undone
  // before the status reaches the client.
  const int64_t big_keys = (int64_t{5} << 20) / (kD * 4);
  const grpc::Status status = Append({{1, 0, 70, RandomValues(rng, 10 * kD)},
                                      {1, 0, 80, std::vector<float>(big_keys * kD, 0.5f)}});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 70);
  EXPECT_EQ(Load().used_blocks(), twin_->Usage().used_blocks);
  AppendBoth(1, 0, RandomValues(rng, 10 * kD), 10);
  ExpectOneRowSelectMatchesTwin(rng, common::v1::DTYPE_FLOAT32, 1, 0, 79);
}

TEST_F(GrpcServiceTest, SelectStreamAnswersAFailedRequestWithItsStatusAndGoesOn) {
  StartServer(8);
  std::mt19937 rng(9);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 82 * kD), 82);
  grpc::ClientContext context;
  auto stream = stub_->SelectStream(&context);
  v1::SelectRequest good;
  good.set_request_id(1);
  AddGroup(&good, 1, 0, 79, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  ASSERT_TRUE(stream->Write(good));
  v1::SelectResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), 1u);
  EXPECT_EQ(response.selections_size(), 1);
  EXPECT_FALSE(response.has_error());
  v1::SelectRequest unknown;
  unknown.set_request_id(2);
  AddGroup(&unknown, 42, 0, 0, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  ASSERT_TRUE(stream->Write(unknown));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), 2u);
  EXPECT_EQ(response.selections_size(), 0);
  EXPECT_EQ(response.error().code(), static_cast<int32_t>(grpc::StatusCode::NOT_FOUND));
  EXPECT_NE(response.error().message().find("42"), std::string::npos) << response.error().message();
  // The same stream still serves the good sequence.
  v1::SelectRequest later;
  later.set_request_id(3);
  AddGroup(&later, 1, 0, 81, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  ASSERT_TRUE(stream->Write(later));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), 3u);
  EXPECT_EQ(response.selections_size(), 1);
  EXPECT_FALSE(response.has_error());
  stream->WritesDone();
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(GrpcServiceTest, KAboveTheBackendsLargestIsRefused) {
  StartServer(8);
  v1::CreateSequenceRequest request = CreateRequest(1, 1, 0.4);
  request.set_top_k(kMaxTopK + 1);
  const grpc::Status status = Create(request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("top_k must be in [1, 2048] (kMaxTopK), got 2049"),
            std::string::npos)
      << status.error_message();
  request.set_top_k(kMaxTopK);
  EXPECT_TRUE(Create(request).ok());
}

TEST_F(GrpcServiceTest, ASelectWhoseAnswerCouldPassTheMessageLimitIsRefusedBeforeItRuns) {
  StartServer(8);
  std::mt19937 rng(33);
  v1::CreateSequenceRequest create = CreateRequest(1, 1, 0.4);
  create.set_top_k(kMaxTopK);
  ASSERT_TRUE(Create(create).ok());
  ASSERT_TRUE(Append({{1, 0, 0, RandomValues(rng, 64 * kD)}}).ok());
  // 8,200 rows of K = 2,048: 8,200 x 8,200 bytes of selections and rates, over 64 MiB (the
  // request itself is 2.2 MB). Before the limit, SelectStream built such an answer and protobuf
  // aborted the process past 2 GB.
  const int rows = 8200;
  ASSERT_GT(SelectResponseBytesBound(rows, kMaxTopK), kMaxReceiveMessageBytes);
  v1::SelectRequest request;
  AddGroup(&request, 1, 0, 0, MakeRows(rng, rows, common::v1::DTYPE_FLOAT32));
  v1::SelectResponse response;
  const grpc::Status status = Select(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("over the message limit of 67108864 bytes"),
            std::string::npos)
      << status.error_message();
  // Refused before anything ran: the layer selects from its first position as before.
  AddGroup(&request, 1, 0, 0, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  request.mutable_groups()->DeleteSubrange(0, 1);
  EXPECT_TRUE(Select(request, &response).ok());
}

// A chunk's request message, serialized (for raw calls).
std::string ChunkBytes(uint64_t id, int layer, int64_t first_slot, const std::vector<float>& keys) {
  v1::AppendIndexKeysRequest request;
  request.set_sequence_id(id);
  request.set_layer(layer);
  request.set_first_slot(first_slot);
  const int64_t shape[] = {static_cast<int64_t>(keys.size()) / kD, kD};
  EncodeFloatTensor(keys, shape, request.mutable_keys());
  return request.SerializeAsString();
}

TEST_F(GrpcServiceTest, AnUnparseableChunkFailsTheAppendAndUndoesItsChunks) {
  StartServer(8);
  std::mt19937 rng(31);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  const std::vector<std::string> messages = {ChunkBytes(1, 0, 0, RandomValues(rng, 10 * kD)),
                                             testing::UnparseableMessage(),
                                             ChunkBytes(1, 0, 10, RandomValues(rng, 10 * kD))};
  const testing::RawCallResult result =
      testing::RawCall(channel_, "/dsa.indexer.v1.IndexerService/AppendIndexKeys", messages);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(result.status.error_message().find(
                "message 1 of the stream is not a valid dsa.indexer.v1.AppendIndexKeysRequest"),
            std::string::npos)
      << result.status.error_message();
  EXPECT_TRUE(result.responses.empty());
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 0);  // the first chunk was appended, then undone
  EXPECT_EQ(Load().used_blocks(), 0);
  // The same bytes without the bad message append both chunks.
  const testing::RawCallResult good = testing::RawCall(
      channel_, "/dsa.indexer.v1.IndexerService/AppendIndexKeys", {messages[0], messages[2]});
  ASSERT_TRUE(good.status.ok()) << good.status.error_message();
  ASSERT_EQ(good.responses.size(), 1u);
  v1::AppendIndexKeysResponse response;
  ASSERT_TRUE(response.ParseFromString(good.responses[0]));
  EXPECT_EQ(response.keys_appended(), 20);
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 20);
}

TEST_F(GrpcServiceTest, AnUnparseableSelectStreamMessageFailsTheStreamNamingIt) {
  StartServer(8);
  std::mt19937 rng(32);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  ASSERT_TRUE(twin_->CreateSequence(1, EngineOptions(1, 0.4)).ok());
  AppendBoth(1, 0, RandomValues(rng, 82 * kD), 82);
  v1::SelectRequest good;
  good.set_request_id(1);
  AddGroup(&good, 1, 0, 79, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));
  v1::SelectRequest later = good;
  later.set_request_id(3);
  later.mutable_groups(0)->set_first_position(81);
  const testing::RawCallResult result = testing::RawCall(
      channel_, "/dsa.indexer.v1.IndexerService/SelectStream",
      {good.SerializeAsString(), testing::UnparseableMessage(), later.SerializeAsString()});
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(result.status.error_message().find(
                "message 1 of the stream is not a valid dsa.indexer.v1.SelectRequest"),
            std::string::npos)
      << result.status.error_message();
  ASSERT_EQ(result.responses.size(), 1u);  // the request before it was answered; none after
  v1::SelectResponse response;
  ASSERT_TRUE(response.ParseFromString(result.responses[0]));
  EXPECT_EQ(response.request_id(), 1u);
  EXPECT_EQ(response.selections_size(), 1);
}

TEST_F(GrpcServiceTest, UnparseableUnaryRequestsGetInvalidArgumentNamingTheMethod) {
  StartServer(8);
  ASSERT_TRUE(Create(CreateRequest(1, 1, 0.4)).ok());
  for (const char* method :
       {"CreateSequence", "Select", "Commit", "BeginTurn", "Release", "GetLoad", "OpenDataPlane"}) {
    const std::string name = absl::StrCat("/dsa.indexer.v1.IndexerService/", method);
    const testing::RawCallResult result =
        testing::RawCall(channel_, name, {testing::UnparseableMessage()});
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(result.status.error_message().find(
                  name + ": the request is not a valid message of the method's request type"),
              std::string::npos)
        << result.status.error_message();
  }
  // Nothing changed: the sequence is still there and a valid raw Release is served as usual.
  EXPECT_EQ(Load().sequences(), 1);
  v1::ReleaseRequest release;
  release.set_sequence_id(1);
  EXPECT_TRUE(testing::RawCall(channel_, "/dsa.indexer.v1.IndexerService/Release",
                               {release.SerializeAsString()})
                  .status.ok());
  EXPECT_EQ(Load().sequences(), 0);
}

TEST_F(GrpcServiceTest, AFailedRequestWithNewIndexKeysAppendsNothing) {
  StartServer(12);  // 12 blocks: room for two sequences of 5 blocks and 2 spare
  std::mt19937 rng(22);
  for (uint64_t id : {1u, 2u}) {
    ASSERT_TRUE(Create(CreateRequest(id, 1, 0.4)).ok());
    ASSERT_TRUE(twin_->CreateSequence(id, EngineOptions(1, 0.4)).ok());
    AppendBoth(id, 0, RandomValues(rng, 320 * kD), 320);  // 5 blocks each
  }
  auto request_for = [&](uint64_t id, int64_t position, int rows, int num_keys) {
    v1::SelectRequest request;
    AddGroup(&request, id, 0, position, MakeRows(rng, rows, common::v1::DTYPE_FLOAT32));
    SetNewKeys(&request, RandomValues(rng, static_cast<size_t>(num_keys) * kD));
    return request;
  };
  v1::SelectResponse response;
  // Rows that do not end at the newest slot.
  grpc::Status status = Select(request_for(1, 320, 1, 2), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("newest slot"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  // Non-finite new keys.
  v1::SelectRequest bad = request_for(1, 320, 1, 1);
  std::vector<float> nan_key(kD, 0.5f);
  nan_key[3] = std::nanf("");
  SetNewKeys(&bad, nan_key);
  status = Select(bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("new_index_keys"), std::string::npos);
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  // Two groups: the first's keys fit (a sixth block), the second's 129 keys need three more blocks
  // than the pool has left: nothing is appended, the first group's keys are removed again.
  v1::SelectRequest both = request_for(1, 320, 1, 1);
  v1::SelectRequest second = request_for(2, 320 + 128, 1, 129);
  *both.add_groups() = second.groups(0);
  status = Select(both, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("group 1 new_index_keys"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  EXPECT_EQ(*indexer_->NumSlots(2, 0), 320);
  EXPECT_EQ(Load().used_blocks(), 10);
  // A select that fails in its second group (position not after the last selected one): the
  // groups have distinct sequences, so all are checked first and nothing is applied, the first
  // group's new key included.
  ASSERT_TRUE(Select(request_for(2, 320, 1, 1), &response).ok());  // sequence 2 selected 320
  v1::SelectRequest replay = request_for(1, 320, 1, 1);
  v1::SelectRequest stale;
  AddGroup(&stale, 2, 0, 320, MakeRows(rng, 1, common::v1::DTYPE_FLOAT32));  // 320 again
  *replay.add_groups() = stale.groups(0);
  status = Select(replay, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("group 1"), std::string::npos) << status.error_message();
  EXPECT_EQ(*indexer_->NumSlots(1, 0), 320);
  EXPECT_EQ(*indexer_->NumSlots(2, 0), 321);
  // Sequence 1 has not selected 320: it still can.
  ASSERT_TRUE(Select(request_for(1, 320, 1, 1), &response).ok());
  // The server goes on serving both sequences.
  ASSERT_TRUE(Select(request_for(1, 321, 1, 1), &response).ok());
  ASSERT_TRUE(Select(request_for(2, 321, 1, 1), &response).ok());
}

}  // namespace
}  // namespace dsa
