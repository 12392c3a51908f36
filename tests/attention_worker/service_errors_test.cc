// Tests of the attention worker service's errors (service_fixture.h): bad requests are precise
// and leave other sequences serving, an indexer of another shape or none creates nothing, a full
// KV cache or index-key cache is RESOURCE_EXHAUSTED, a prefill its caller cancelled leaves nothing
// behind, and an indexer gone during decode is UNAVAILABLE.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/attention_worker/service_fixture.h"

namespace dsa {
namespace {

using namespace ::dsa::attention_service_testing;  // NOLINT(google-build-using-namespace)

TEST_F(AttentionServiceTest, BadRequestsArePreciseAndLeaveOtherSequencesServing) {
  Start(/*indexer_blocks=*/512);
  MustPrefill(PrefillRequest(30, 700));
  TwinPrefill(30, 700);
  av1::PrefillResponse prefilled;
  av1::DecodeStepResponse response;

  EXPECT_EQ(Prefill(PrefillRequest(30, 500), &prefilled).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Prefill(PrefillRequest(31, 0), &prefilled).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Prefill(PrefillRequest(31, 600, {1, 2, 3}), &prefilled).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // 3 ids > ceil(600 / 512)
  av1::PrefillRequest bad_prefix = PrefillRequest(31, 600);
  bad_prefix.set_prefix_source_id(30);
  bad_prefix.set_prefix_slots(100);  // not a multiple of 64
  EXPECT_EQ(Prefill(bad_prefix, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_prefix.set_prefix_slots(640);  // beyond the context
  EXPECT_EQ(Prefill(bad_prefix, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad_prefix.set_prefix_source_id(77);  // unknown source: the indexer's NOT_FOUND
  bad_prefix.set_prefix_slots(512);
  EXPECT_EQ(Prefill(bad_prefix, &prefilled).error_code(), grpc::StatusCode::NOT_FOUND);
  av1::PrefillRequest no_top_k = PrefillRequest(31, 600);
  no_top_k.mutable_settings()->set_top_k(0);
  EXPECT_EQ(Prefill(no_top_k, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  av1::PrefillRequest bad_spin = PrefillRequest(31, 600);
  bad_spin.mutable_settings()->mutable_spin()->set_target_block_sparsity(1.5);
  EXPECT_EQ(Prefill(bad_spin, &prefilled).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  av1::PrefillRequest wide = PrefillRequest(31, 600);
  wide.mutable_settings()->set_top_k(kMaxTopK + 1);  // above what the backends take
  const grpc::Status wide_status = Prefill(wide, &prefilled);
  EXPECT_EQ(wide_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(wide_status.error_message().find("(kMaxTopK)"), std::string::npos);
  // An indexer address that is not host:port is refused before anything is dialed (it was
  // UNKNOWN from the channel before).
  for (const char* address : {"no-port", "host:0", "host:99999", "two words:50052", "::1:50052"}) {
    av1::PrefillRequest bad_address = PrefillRequest(31, 600);
    bad_address.set_indexer_worker(address);
    const grpc::Status status = Prefill(bad_address, &prefilled);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << address;
    EXPECT_EQ(status.error_message().rfind("indexer_worker: ", 0), 0u) << status.error_message();
  }

  EXPECT_EQ(Step({{99, 1}}, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Step({{30, 1}, {99, 1}}, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Step({{30, 0}}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Step({{30, 6}}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Step({{30, 1}, {30, 1}}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Step({}, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Commit(99, 0).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Release(99).error_code(), grpc::StatusCode::NOT_FOUND);

  // Nothing of those is left behind, and the good sequence steps on.
  EXPECT_EQ(indexer_->Load().sequences(), 1);
  EXPECT_EQ(Info().sequences(), 1);
  EXPECT_EQ(Info().kv_used_slots(), 700);
  ASSERT_TRUE(Step({{30, 1}}, &response).ok());
  ExpectAttended(30, 700, 1, TwinStep(30, 700, 1));
  ASSERT_TRUE(Release(30).ok());
  EXPECT_EQ(indexer_->Load().sequences(), 0);
  EXPECT_EQ(indexer_->Load().used_blocks(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(Release(30).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(AttentionServiceTest, IndexerShapeMismatchAndUnreachableIndexerCreateNothing) {
  Start(/*indexer_blocks=*/512);
  auto other = StartIndexer(512, /*num_heads=*/4, /*head_dim=*/kD);
  av1::PrefillResponse prefilled;
  av1::PrefillRequest request = PrefillRequest(40, 600);
  request.set_indexer_worker(other->address);
  const grpc::Status mismatch = Prefill(request, &prefilled);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(mismatch.error_message().find("H = 4"), std::string::npos) << mismatch.error_message();
  EXPECT_EQ(other->Load().sequences(), 0);

  // A port where nothing listens (a server started and stopped).
  auto gone = StartIndexer(16);
  const std::string gone_address = gone->address;
  gone->server->Shutdown();
  gone.reset();
  request.set_indexer_worker(gone_address);
  const grpc::Status unreachable = Prefill(request, &prefilled);
  EXPECT_EQ(unreachable.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(unreachable.error_message().find(gone_address), std::string::npos)
      << unreachable.error_message();

  // An address past kMaxAddressBytes is refused by its size, the message the server's own (a
  // message quoting it would pass gRPC's metadata limit and reach the client as another error).
  request.set_indexer_worker("unix:/" + std::string(20000, 'a'));
  const grpc::Status too_long = Prefill(request, &prefilled);
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << too_long.error_message();
  EXPECT_NE(too_long.error_message().find("20006 bytes, over the 1024-byte limit"),
            std::string::npos)
      << too_long.error_message();

  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  // The id is free again.
  ASSERT_TRUE(Prefill(PrefillRequest(40, 600), &prefilled).ok());
  other->server->Shutdown();
}

TEST_F(AttentionServiceTest, KvCapacityIsResourceExhaustedWithNothingLeftOnTheIndexer) {
  Start(/*indexer_blocks=*/512, "FSFSFS", 1, /*kv_capacity_slots=*/1500);
  av1::PrefillResponse prefilled;
  ASSERT_TRUE(Prefill(PrefillRequest(50, 1000), &prefilled).ok());
  TwinPrefill(50, 1000);
  const iv1::GetLoadResponse before = indexer_->Load();
  EXPECT_EQ(Prefill(PrefillRequest(51, 501), &prefilled).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  const iv1::GetLoadResponse after = indexer_->Load();
  EXPECT_EQ(after.sequences(), before.sequences());
  EXPECT_EQ(after.used_blocks(), before.used_blocks());
  EXPECT_EQ(Info().sequences(), 1);
  EXPECT_EQ(Info().kv_used_slots(), 1000);
  // Exactly full is fine; a step past the capacity is refused and changes nothing.
  ASSERT_TRUE(Prefill(PrefillRequest(51, 500), &prefilled).ok());
  av1::DecodeStepResponse response;
  EXPECT_EQ(Step({{50, 1}}, &response).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(*indexer_->indexer->NumSlots(50, 0), 1000);
  ASSERT_TRUE(Release(51).ok());
  ASSERT_TRUE(Step({{50, 1}}, &response).ok());
  ExpectAttended(50, 1000, 1, TwinStep(50, 1000, 1));
}

TEST_F(AttentionServiceTest, IndexKeyCacheFullDuringPrefillOrStep) {
  // 3 full layers; 1536 slots = 24 blocks a layer, 72 in all; 64 slots = 3 blocks.
  Start(/*indexer_blocks=*/76);
  av1::PrefillResponse prefilled;
  // 2000 slots need 96 blocks: the append fails and the created sequence is released again.
  EXPECT_EQ(Prefill(PrefillRequest(60, 2000), &prefilled).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(indexer_->Load().sequences(), 0);
  EXPECT_EQ(indexer_->Load().used_blocks(), 0);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);

  ASSERT_TRUE(Prefill(PrefillRequest(60, 1536), &prefilled).ok());
  ASSERT_TRUE(Prefill(PrefillRequest(61, 64), &prefilled).ok());
  TwinPrefill(60, 1536);
  EXPECT_EQ(indexer_->Load().free_blocks(), 1);
  // Slot 1536 starts a new block in each of the 3 layers: the first full layer takes the last
  // free block and selects (the indexer has advanced it), the second cannot append: the step
  // fails and sequence 60 is broken.
  av1::DecodeStepResponse response;
  const grpc::Status failed = Step({{60, 1}}, &response);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(failed.error_message().find("broken"), std::string::npos) << failed.error_message();
  EXPECT_EQ(Info().kv_used_slots(), 1536 + 64);
  const grpc::Status broken = Step({{60, 1}}, &response);
  EXPECT_EQ(broken.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(broken.error_message().find("broken"), std::string::npos);
  // The other sequence is untouched: its step fails at the first layer's append (no free
  // block, nothing applied) without breaking it, then succeeds once there is room.
  EXPECT_EQ(Step({{61, 1}}, &response).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_TRUE(Release(60).ok());
  TwinPrefill(61, 64);
  ASSERT_TRUE(Step({{61, 1}}, &response).ok());
  ExpectAttended(61, 64, 1, TwinStep(61, 64, 1));
}

// A prefill whose caller gave up while it ran leaves nothing behind: the worker runs it to its
// end, then drops the sequence on itself and on the indexer, since the caller's Release may have
// come before the sequence existed. The prefill is held mid-way (PrefillHold) until the worker's
// side of the call is cancelled, so the cancellation always lands while it runs.
TEST_F(AttentionServiceTest, APrefillItsCallerCancelledLeavesNothingBehind) {
  PrefillHold hold;
  hold_ = &hold;
  prefill_calls_owned_ = std::make_unique<PrefillCalls>();
  prefill_calls_ = prefill_calls_owned_.get();
  Start(/*indexer_blocks=*/512);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::Status status;
  std::thread caller([&] {
    av1::PrefillResponse response;
    status = stub_->Prefill(&context, PrefillRequest(5, 4000), &response);
  });
  // Whatever fails below, the prefill ends and the caller returns.
  struct Cleanup {
    std::function<void()> run;
    ~Cleanup() { run(); }
  } cleanup{[&] {
    context.TryCancel();
    if (!hold.release.HasBeenNotified()) hold.release.Notify();
    if (caller.joinable()) caller.join();
  }};
  ASSERT_TRUE(hold.entered.WaitForNotificationWithTimeout(absl::Seconds(60)));
  // Mid-way: the sequence exists on both workers, its KV is held.
  EXPECT_EQ(Info().sequences(), 1);
  EXPECT_EQ(Info().kv_used_slots(), 4000);
  EXPECT_EQ(indexer_->Load().sequences(), 1);
  context.TryCancel();
  caller.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  // The worker sees the cancellation only when its transport has read it; the sync API has no
  // event for that, so the held prefill goes on once IsCancelled() says so.
  grpc::ServerContextBase* server_context = prefill_calls_->context();
  ASSERT_NE(server_context, nullptr);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!server_context->IsCancelled() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(server_context->IsCancelled());
  hold.release.Notify();
  ASSERT_TRUE(prefill_calls_->answered.WaitForNotificationWithTimeout(absl::Seconds(60)));
  // The prefill ran to its end (its duration recorded), then what it made was dropped.
  EXPECT_EQ(prefill_calls_->status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(prefill_calls_->status.error_message(),
            "the caller cancelled the prefill: what it made was released");
  EXPECT_EQ(MetricValue(*registry_, "dsa_attention_prefill_duration_seconds", "", ""), 1);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(indexer_->Load().sequences(), 0);
  EXPECT_EQ(service_->owned_sequences(), 0u);
}

TEST_F(AttentionServiceTest, IndexerGoneDuringDecodeIsUnavailable) {
  Start(/*indexer_blocks=*/512);
  MustPrefill(PrefillRequest(90, 700));
  av1::DecodeStepResponse response;
  ASSERT_TRUE(Step({{90, 1}}, &response).ok());
  // The indexer stops (its select stream cancelled after 100 ms).
  indexer_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  const grpc::Status gone = Step({{90, 1}}, &response);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::UNAVAILABLE) << gone.error_message();
  EXPECT_NE(gone.error_message().find(indexer_->address), std::string::npos)
      << gone.error_message();
  EXPECT_EQ(Info().kv_used_slots(), 701);  // the failed step's KV rows are gone
  // Release drops the KV even though the indexer cannot be told.
  const grpc::Status released = Release(90);
  EXPECT_EQ(released.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Info().kv_used_slots(), 0);
  EXPECT_EQ(Info().sequences(), 0);
  EXPECT_EQ(service_->owned_sequences(), 0u);  // nor is its owner kept
}

}  // namespace
}  // namespace dsa
