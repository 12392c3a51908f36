// Tests of the coordinator's admission and placement logic (coordinator/scheduler.h): block math,
// the too-large and queue-full refusals, FIFO admission, LRU eviction of retained sequences,
// prefix-aware placement (whole 512-slot blocks, caps, donors in a speculative step), pinned
// donors, sessions and attention-worker choice. Expected values are worked out by hand.
#include "coordinator/scheduler.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

SequenceDemand Demand(int64_t context, int64_t max_new, int draft = 0,
                      std::vector<uint64_t> prefix = {}, std::string session = "") {
  SequenceDemand d;
  d.context_length = context;
  d.max_new_tokens = max_new;
  d.draft_length = draft;
  d.prefix_block_ids = std::move(prefix);
  d.session_id = std::move(session);
  return d;
}

Scheduler Make(int layers, std::vector<int64_t> capacities, int num_attention = 1,
               int max_queue = 4, int max_running = 8, bool retain = true,
               int64_t kv_capacity = 0) {
  SchedulerOptions options;
  options.num_full_layers = layers;
  options.max_queue = max_queue;
  options.max_running_per_attention = max_running;
  options.retain_finished = retain;
  std::vector<IndexerWorkerInfo> indexers;
  for (size_t i = 0; i < capacities.size(); ++i) {
    indexers.push_back({"indexer" + std::to_string(i), capacities[i]});
  }
  std::vector<AttentionWorkerInfo> attentions;
  attentions.reserve(num_attention);
  for (int j = 0; j < num_attention; ++j) {
    attentions.push_back({"attention" + std::to_string(j), kv_capacity});
  }
  auto scheduler = Scheduler::Create(options, indexers, attentions);
  EXPECT_TRUE(scheduler.ok()) << scheduler.status();
  return *std::move(scheduler);
}

// Submits and expects an immediate admission.
Admission Admit(Scheduler& s, uint64_t ticket, const SequenceDemand& demand) {
  auto result = s.Submit(ticket, demand);
  EXPECT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result.ok() && result->has_value()) << "ticket " << ticket << " was queued";
  return result.ok() && result->has_value() ? **result : Admission{};
}

// Finish, then ReleaseDone when the attention worker is to be released.
Scheduler::FinishResult End(Scheduler& s, uint64_t sequence_id, bool completed, int64_t length) {
  Scheduler::FinishResult result = s.Finish(sequence_id, completed, length);
  if (result.release_attention) s.ReleaseDone(sequence_id);
  return result;
}

// Admits, prefills and completes a one-off request; returns its sequence id.
uint64_t RunToRetained(Scheduler& s, uint64_t ticket, const SequenceDemand& demand) {
  const Admission a = Admit(s, ticket, demand);
  s.PrefillDone(a.sequence_id);
  End(s, a.sequence_id, true, demand.context_length + demand.max_new_tokens);
  return a.sequence_id;
}

TEST(SchedulerTest, CreateRefusesBadOptions) {
  SchedulerOptions options;
  EXPECT_TRUE(Scheduler::Create(options, {}, {}).ok());  // workers may come later
  EXPECT_FALSE(Scheduler::Create(options, {{"i", -1}}, {}).ok());
  options.num_full_layers = 0;
  EXPECT_FALSE(Scheduler::Create(options, {{"i", 10}}, {{"a", 0}}).ok());
}

// Workers added later get the next index; one that is not ready is not placed on, and what it
// holds stays; once ready again it is placed on.
TEST(SchedulerTest, AddedWorkersArePlacedOnOnlyWhileReady) {
  SchedulerOptions options;
  options.num_full_layers = 1;
  auto created = Scheduler::Create(options, {}, {});
  ASSERT_TRUE(created.ok());
  Scheduler& s = *created;
  EXPECT_EQ(s.ReadyIndexers(), 0);
  EXPECT_EQ(*s.AddIndexer({"i0", 100}), 0);
  EXPECT_EQ(*s.AddIndexer({"i1", 100}), 1);
  EXPECT_EQ(*s.AddAttention({"a0", 0}), 0);
  EXPECT_EQ(s.AddIndexer({"bad", -1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ReadyIndexers(), 2);
  EXPECT_EQ(s.ReadyAttentions(), 1);
  ASSERT_TRUE(s.SetIndexerReady(0, false).ok());
  EXPECT_EQ(s.SetIndexerReady(2, false).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(s.ReadyIndexers(), 1);
  for (uint64_t ticket = 1; ticket <= 3; ++ticket) {
    EXPECT_EQ(Admit(s, ticket, Demand(100, 10)).indexer, 1) << ticket;
  }
  // No ready attention worker: refused at once (UNAVAILABLE), nothing queued.
  ASSERT_TRUE(s.SetAttentionReady(0, false).ok());
  const absl::Status refused = s.Submit(4, Demand(100, 10)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_EQ(s.Load().queued, 0);
  ASSERT_TRUE(s.SetAttentionReady(0, true).ok());
  EXPECT_EQ(Admit(s, 5, Demand(100, 10)).indexer, 1);
  // num_full_layers changes only while nothing is held or queued.
  EXPECT_EQ(s.SetNumFullLayers(2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.SetNumFullLayers(0).code(), absl::StatusCode::kInvalidArgument);
}

// Drawn sequence ids: a draw of 0 or of an id still held is drawn again; a released id may come
// back.
TEST(SchedulerTest, DrawnSequenceIdsSkipZeroAndHeldIds) {
  SchedulerOptions options;
  options.retain_finished = false;
  std::vector<uint64_t> draws = {41, 41, 0, 7, 41};
  size_t next = 0;
  options.draw_sequence_id = [&draws, &next] { return draws.at(next++); };
  auto created = Scheduler::Create(options, {{"i0", 100}}, {{"a0", 0}});
  ASSERT_TRUE(created.ok());
  Scheduler& s = *created;
  EXPECT_EQ(Admit(s, 1, Demand(10, 1)).sequence_id, 41u);
  EXPECT_EQ(Admit(s, 2, Demand(10, 1)).sequence_id, 7u);  // 41 held, 0 never an id
  EXPECT_EQ(next, 4u);
  (void)s.Finish(41, /*completed=*/true, 11);
  (void)s.ReleaseDone(41);
  EXPECT_EQ(Admit(s, 3, Demand(10, 1)).sequence_id, 41u);
}

// A queued request that only a worker that left could hold is taken out for the caller to fail;
// the others stay queued in order.
TEST(SchedulerTest, QueuedRequestsNoReadyWorkerCanHoldAreTakenOut) {
  Scheduler s = Make(/*layers=*/1, {100, 20}, /*num_attention=*/1);
  // Fill indexer 0 so that the next large request queues.
  const Admission big = Admit(s, 1, Demand(64 * 60, 10));
  EXPECT_EQ(big.indexer, 0);
  ASSERT_TRUE(s.Submit(2, Demand(64 * 60, 10)).ok());  // 61 blocks: only indexer 0 holds that
  ASSERT_TRUE(s.Submit(3, Demand(64, 10)).ok());       // queued behind it (FIFO)
  EXPECT_EQ(s.Load().queued, 2);
  EXPECT_TRUE(s.TakeUnplaceableQueued().empty());
  ASSERT_TRUE(s.SetIndexerReady(0, false).ok());
  EXPECT_EQ(s.TakeUnplaceableQueued(), std::vector<uint64_t>{2});
  const std::vector<Admission> admitted = s.AdmitQueued();  // ticket 3 fits indexer 1
  ASSERT_EQ(admitted.size(), 1u);
  EXPECT_EQ(admitted[0].ticket, 3u);
  EXPECT_EQ(admitted[0].indexer, 1);
}

// A session whose workers are not ready starts its next turn afresh on ready workers instead of
// waiting; a retired worker's retained sequences are forgotten and it is never ready again.
TEST(SchedulerTest, SessionsMoveOffWorkersThatAreNotReadyAndRetiredWorkersForgetTheirDonors) {
  Scheduler s = Make(/*layers=*/1, {1000, 1000}, /*num_attention=*/1);
  SequenceDemand turn1 = Demand(600, 10);
  turn1.session_id = "chat";
  const Admission first = Admit(s, 1, turn1);
  s.PrefillDone(first.sequence_id);
  End(s, first.sequence_id, /*completed=*/true, 610);
  ASSERT_TRUE(s.SetIndexerReady(first.indexer, false).ok());
  SequenceDemand turn2 = Demand(700, 10);
  turn2.session_id = "chat";
  const Admission second = Admit(s, 2, turn2);
  EXPECT_FALSE(second.continue_sequence);
  EXPECT_NE(second.sequence_id, first.sequence_id);
  EXPECT_NE(second.indexer, first.indexer);

  const int retained_before = s.Load().retained;
  EXPECT_GE(retained_before, 1);  // the first turn's sequence, kept as a plain retained one
  absl::StatusOr<std::vector<Eviction>> forgotten = s.RetireIndexer(first.indexer);
  ASSERT_TRUE(forgotten.ok());
  EXPECT_EQ(s.Load().retained, retained_before - 1);
  // The surviving attention worker still holds the first turn's KV: its release is returned.
  ASSERT_EQ(forgotten->size(), 1u);
  EXPECT_EQ((*forgotten)[0].sequence_id, first.sequence_id);
  EXPECT_TRUE((*forgotten)[0].release_on_both);
  EXPECT_EQ(s.SetIndexerReady(first.indexer, true).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.RetireIndexer(7).status().code(), absl::StatusCode::kOutOfRange);
}

// Found by fuzz_coordinator_service: a session turn still running when its indexer restarted
// (retired) completed afterwards and was kept, so the coordinator counted a session whose index
// keys the new process never had, and its KV stayed on the attention worker for good.
TEST(SchedulerTest, ASequenceThatRanWhileItsWorkerWasRetiredIsNotKept) {
  for (const bool retire_indexer : {true, false}) {
    SCOPED_TRACE(retire_indexer ? "indexer retired" : "attention retired");
    Scheduler s = Make(/*layers=*/1, {1000, 1000, 1000}, /*num_attention=*/3);
    const Admission session = Admit(s, 1, Demand(600, 10, 0, {}, "chat"));
    const Admission donor = Admit(s, 2, Demand(600, 10));  // would be kept as a prefix donor
    s.PrefillDone(session.sequence_id);
    s.PrefillDone(donor.sequence_id);
    ASSERT_TRUE(
        (retire_indexer ? s.RetireIndexer(session.indexer) : s.RetireAttention(session.attention))
            .ok());
    // (Its worker may be the session's, retired already: retiring twice is fine.)
    ASSERT_TRUE(
        (retire_indexer ? s.RetireIndexer(donor.indexer) : s.RetireAttention(donor.attention))
            .ok());

    const Scheduler::FinishResult ended = s.Finish(session.sequence_id, true, 610);
    EXPECT_TRUE(ended.release_attention);  // released on the survivor, not kept
    EXPECT_FALSE(ended.keep_indexer_sequence);
    const Scheduler::FinishResult donor_ended = s.Finish(donor.sequence_id, true, 610);
    EXPECT_TRUE(donor_ended.release_attention);
    EXPECT_FALSE(donor_ended.keep_indexer_sequence);
    s.ReleaseDone(session.sequence_id);
    s.ReleaseDone(donor.sequence_id);
    EXPECT_EQ(s.Load().retained, 0);
    EXPECT_EQ(s.Load().running, 0);
    // The session's next turn starts afresh on the workers left.
    const Admission next = Admit(s, 3, Demand(700, 10, 0, {}, "chat"));
    EXPECT_FALSE(next.continue_sequence);
    EXPECT_NE(next.sequence_id, session.sequence_id);
  }
}

TEST(SchedulerColocatedTest, WorkersAreAddedInPairsAtOneAddress) {
  SchedulerOptions options;
  options.colocated = true;
  auto created = Scheduler::Create(options, {}, {});
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->AddAttention({"a0", 0}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(created->AddIndexer({"a0", 100}).ok());
  EXPECT_EQ(created->AddIndexer({"a1", 100}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(created->AddAttention({"a1", 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*created->AddAttention({"a0", 0}), 0);
}

TEST(SchedulerTest, BlocksAreFullLayersTimesCeilOfContextNewTokensAndDraft) {
  Scheduler s = Make(/*layers=*/3, {100});
  // ceil((100 + 20 + 4) / 64) = 2 blocks per layer, 3 layers.
  EXPECT_EQ(s.BlocksNeeded(Demand(100, 20, 4)), 6);
  // 64 + 0 + 0 would be one block; 60 + 4 = 64 is one block; 61 + 4 is two.
  EXPECT_EQ(s.BlocksNeeded(Demand(60, 4)), 3);
  EXPECT_EQ(s.BlocksNeeded(Demand(61, 4)), 6);
  Admission a = Admit(s, 1, Demand(100, 20, 4));
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 6);
  EXPECT_EQ(s.Load().running, 1);
  End(s, a.sequence_id, false, 0);  // failed: everything freed
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 0);
  EXPECT_EQ(s.Load().running, 0);
  EXPECT_EQ(s.Load().retained, 0);
}

TEST(SchedulerTest, LargerThanAnyWorkerIsRefusedAtOnceWithTheNumbers) {
  Scheduler s = Make(2, {8, 6});
  // ceil(301 / 64) = 5 blocks per layer, 10 in all; the largest worker has 8.
  auto result = s.Submit(1, Demand(300, 1));
  ASSERT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(result.status().message(), HasSubstr("needs 10 index-key-cache blocks"));
  EXPECT_THAT(result.status().message(), HasSubstr("largest: 8 blocks"));
  EXPECT_EQ(s.Load().queued, 0);

  Scheduler kv = Make(1, {1000}, 2, 4, 8, true, /*kv_capacity=*/500);
  auto kv_result = kv.Submit(1, Demand(450, 100));
  ASSERT_EQ(kv_result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(kv_result.status().message(), HasSubstr("needs 550 KV slots"));
}

TEST(SchedulerTest, QueuesInFifoOrderAndRefusesWhenTheQueueIsFull) {
  Scheduler s = Make(2, {8}, 1, /*max_queue=*/2, 8, /*retain=*/false);
  const SequenceDemand whole = Demand(200, 50);  // ceil(250 / 64) = 4 per layer: 8 blocks
  const Admission a = Admit(s, 1, whole);
  auto b = s.Submit(2, Demand(10, 1));  // the worker is full and nothing is retained: waits
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->has_value());
  auto c = s.Submit(3, Demand(10, 1));
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->has_value());
  auto d = s.Submit(4, Demand(10, 1));
  ASSERT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(d.status().message(), HasSubstr("queue full"));
  EXPECT_EQ(s.Load().queued, 2);
  EXPECT_TRUE(s.AdmitQueued().empty());  // nothing freed yet

  s.PrefillDone(a.sequence_id);
  const Scheduler::FinishResult finished = s.Finish(a.sequence_id, true, 250);
  EXPECT_TRUE(finished.release_attention);
  EXPECT_FALSE(finished.keep_indexer_sequence);  // retain off
  // The attention worker still holds the blocks until its Release returns.
  EXPECT_TRUE(s.AdmitQueued().empty());
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 8);
  s.ReleaseDone(a.sequence_id);
  std::vector<Admission> admitted = s.AdmitQueued();
  ASSERT_EQ(admitted.size(), 2u);
  EXPECT_EQ(admitted[0].ticket, 2u);
  EXPECT_EQ(admitted[1].ticket, 3u);
  EXPECT_EQ(s.Load().queued, 0);
}

TEST(SchedulerTest, LaterRequestsWaitBehindTheQueueHead) {
  Scheduler s = Make(1, {4}, 1, 4, 8, false);
  const Admission a = Admit(s, 1, Demand(100, 28));         // 2 blocks
  ASSERT_FALSE(s.Submit(2, Demand(150, 42))->has_value());  // 3 blocks: waits
  // One block would fit now, but the queue is not empty: FIFO, so it waits too.
  ASSERT_FALSE(s.Submit(3, Demand(10, 1))->has_value());
  EXPECT_TRUE(s.CancelQueued(2));
  EXPECT_FALSE(s.CancelQueued(2));
  std::vector<Admission> admitted = s.AdmitQueued();
  ASSERT_EQ(admitted.size(), 1u);
  EXPECT_EQ(admitted[0].ticket, 3u);
  End(s, a.sequence_id, false, 0);
}

TEST(SchedulerTest, EvictsRetainedSequencesLeastRecentlyUsedFirst) {
  Scheduler s = Make(1, {4});
  const uint64_t a = RunToRetained(s, 1, Demand(10, 1));  // 1 block each
  const uint64_t b = RunToRetained(s, 2, Demand(10, 1));
  const uint64_t c = RunToRetained(s, 3, Demand(10, 1));
  const uint64_t d = RunToRetained(s, 4, Demand(10, 1));
  EXPECT_EQ(s.Load().retained, 4);
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 4);
  const Admission e = Admit(s, 5, Demand(100, 20));  // 2 blocks: the two oldest go
  ASSERT_EQ(e.evictions.size(), 2u);
  EXPECT_EQ(e.evictions[0].sequence_id, a);
  EXPECT_EQ(e.evictions[1].sequence_id, b);
  EXPECT_FALSE(e.evictions[0].release_on_attention);  // donors' KV is already gone
  EXPECT_EQ(s.Load().retained, 2);
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 4);
  (void)c;
  (void)d;
}

TEST(SchedulerTest, PlacesOnTheWorkerWithTheLongestPrefixRun) {
  Scheduler s = Make(1, {100, 100});
  // Donor on indexer 0 (tie -> lower index) with whole blocks [1, 2] (1100 >= 2 * 512).
  const uint64_t donor = RunToRetained(s, 1, Demand(1100, 10, 0, {1, 2, 3}));
  // A second sequence makes indexer 0 the more loaded one.
  const Admission r = Admit(s, 2, Demand(1500, 10, 0, {1, 2, 3}));
  EXPECT_EQ(r.indexer, 0);
  ASSERT_TRUE(r.prefix_source_id.has_value());
  EXPECT_EQ(*r.prefix_source_id, donor);
  EXPECT_EQ(r.prefix_slots, 1024);  // donor's third block is not whole in its prompt
  // Blocks: donor 18 (ceil(1110/64)); r shares 16 of its 24 (ceil(1510/64)): 18 + 8.
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 26);

  const Admission miss = Admit(s, 3, Demand(600, 10, 0, {7}));
  EXPECT_EQ(miss.indexer, 1);  // no prefix anywhere: least loaded
  EXPECT_FALSE(miss.prefix_source_id.has_value());

  const Admission partial = Admit(s, 4, Demand(600, 10, 0, {1, 9}));
  EXPECT_EQ(partial.indexer, 0);
  EXPECT_EQ(partial.prefix_slots, 512);
}

TEST(SchedulerTest, PrefixSlotsAreCappedByTheContextAtAWhole64SlotBlock) {
  Scheduler s = Make(1, {100});
  const uint64_t donor = RunToRetained(s, 1, Demand(1024, 1, 0, {1, 2}));
  const Admission r = Admit(s, 2, Demand(700, 1, 0, {1, 2}));
  ASSERT_TRUE(r.prefix_source_id.has_value());
  EXPECT_EQ(*r.prefix_source_id, donor);
  EXPECT_EQ(r.prefix_slots, 640);  // floor(700 / 64) * 64
  const Admission tiny = Admit(s, 3, Demand(63, 1, 0, {1}));
  EXPECT_FALSE(tiny.prefix_source_id.has_value());  // not one whole 64-slot block
}

TEST(SchedulerTest, RunningDonorsOnlyWithoutSpeculativeStepsAndAfterPrefill) {
  Scheduler s = Make(1, {200});
  const Admission spec = Admit(s, 1, Demand(1024, 100, 2, {5}));
  const Admission prefilling = Admit(s, 2, Demand(1024, 100, 0, {6}));
  s.PrefillDone(spec.sequence_id);
  EXPECT_FALSE(Admit(s, 3, Demand(600, 1, 0, {5})).prefix_source_id.has_value());
  EXPECT_FALSE(Admit(s, 4, Demand(600, 1, 0, {6})).prefix_source_id.has_value());
  s.PrefillDone(prefilling.sequence_id);
  const Admission shared = Admit(s, 5, Demand(600, 1, 0, {6}));
  ASSERT_TRUE(shared.prefix_source_id.has_value());
  EXPECT_EQ(*shared.prefix_source_id, prefilling.sequence_id);
}

TEST(SchedulerTest, AFinishedDonorIsUsableWhileItsKvReleaseIsInFlight) {
  Scheduler s = Make(1, {100});
  const Admission donor = Admit(s, 1, Demand(600, 4, 0, {3}));
  s.PrefillDone(donor.sequence_id);
  EXPECT_TRUE(s.Finish(donor.sequence_id, true, 604).keep_indexer_sequence);
  const Admission user = Admit(s, 2, Demand(600, 4, 0, {3}));
  ASSERT_TRUE(user.prefix_source_id.has_value());
  EXPECT_EQ(*user.prefix_source_id, donor.sequence_id);
  EXPECT_EQ(user.prefix_slots, 512);
  EXPECT_TRUE(s.ReleaseDone(donor.sequence_id).empty());
  EXPECT_EQ(s.Load().retained, 1);
}

TEST(SchedulerTest, APinnedDonorIsNotEvictedAndIsReleasedWhenUnpinnedIfNotRetained) {
  Scheduler s = Make(1, {40}, 1, 4, 8, /*retain=*/false);
  const Admission donor = Admit(s, 1, Demand(1024, 64, 0, {1, 2}));  // 17 blocks
  s.PrefillDone(donor.sequence_id);
  const Admission user = Admit(s, 2, Demand(1024, 64, 0, {1, 2}));  // shares 16, adds 1
  ASSERT_TRUE(user.prefix_source_id.has_value());
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 18);
  // The donor finishes while the user's prefill still reads it: kept on the indexer.
  Scheduler::FinishResult finished = End(s, donor.sequence_id, true, 1088);
  EXPECT_TRUE(finished.keep_indexer_sequence);
  EXPECT_EQ(s.Load().retained, 1);
  // A request needing every free block and more cannot evict it.
  auto big = s.Submit(3, Demand(1400, 64));  // 23 blocks; 22 free; the donor frees 1
  ASSERT_TRUE(big.ok());
  EXPECT_FALSE(big->has_value());
  // Prefill done: the donor is released (retain off); its one unshared block frees and the
  // queued request fits.
  std::vector<Eviction> released = s.PrefillDone(user.sequence_id);
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].sequence_id, donor.sequence_id);
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 17);
  EXPECT_EQ(s.AdmitQueued().size(), 1u);
}

TEST(SchedulerTest, ADonorWhosePinEndsWhileItsReleaseIsInFlightIsReleasedAfterwards) {
  Scheduler s = Make(1, {40}, 1, 4, 8, /*retain=*/false);
  const Admission donor = Admit(s, 1, Demand(1024, 64, 0, {1, 2}));
  s.PrefillDone(donor.sequence_id);
  const Admission user = Admit(s, 2, Demand(1024, 64, 0, {1, 2}));
  ASSERT_TRUE(user.prefix_source_id.has_value());
  EXPECT_TRUE(s.Finish(donor.sequence_id, true, 1088).keep_indexer_sequence);
  EXPECT_TRUE(s.PrefillDone(user.sequence_id).empty());  // the donor's Release is in flight
  std::vector<Eviction> released = s.ReleaseDone(donor.sequence_id);
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].sequence_id, donor.sequence_id);
  EXPECT_FALSE(released[0].release_on_attention);
  EXPECT_EQ(s.Load().retained, 0);
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 17);
}

TEST(SchedulerTest, SessionsContinueTheirSequenceAndAreEvictedLikeDonors) {
  Scheduler s = Make(1, {10});
  const Admission t1 = Admit(s, 1, Demand(100, 20, 0, {}, "chat"));
  EXPECT_FALSE(t1.continue_sequence);
  auto busy = s.Submit(2, Demand(200, 20, 0, {}, "chat"));
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition);
  s.PrefillDone(t1.sequence_id);
  Scheduler::FinishResult finished = s.Finish(t1.sequence_id, true, 120);
  EXPECT_FALSE(finished.release_attention);  // KV and index keys stay
  EXPECT_EQ(s.Load().retained, 1);

  auto shorter = s.Submit(3, Demand(119, 20, 0, {}, "chat"));
  EXPECT_EQ(shorter.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shorter.status().message(), HasSubstr("holds 120 slots"));

  const Admission t2 = Admit(s, 4, Demand(300, 20, 0, {}, "chat"));  // 5 blocks
  EXPECT_TRUE(t2.continue_sequence);
  EXPECT_EQ(t2.sequence_id, t1.sequence_id);
  EXPECT_EQ(s.Load().indexers[0].used_blocks, 5);
  s.PrefillDone(t2.sequence_id);
  EXPECT_FALSE(End(s, t2.sequence_id, true, 320).release_attention);

  // Another request needs the space: the idle session goes (released on its attention worker).
  const Admission other = Admit(s, 5, Demand(500, 20));  // 9 blocks
  ASSERT_EQ(other.evictions.size(), 1u);
  EXPECT_EQ(other.evictions[0].sequence_id, t1.sequence_id);
  EXPECT_TRUE(other.evictions[0].release_on_attention);
  End(s, other.sequence_id, false, 0);
  const Admission t3 = Admit(s, 6, Demand(400, 20, 0, {}, "chat"));
  EXPECT_FALSE(t3.continue_sequence);  // starts afresh
  EXPECT_NE(t3.sequence_id, t1.sequence_id);
}

// A real model's session keeps its tokens: the next turn's must start with them (refused with the
// first position that differs, nothing changed), and its admission says where the sequence ends.
TEST(SchedulerTest, ASessionWithATokenHistoryRefusesATurnThatDoesNotStartWithIt) {
  Scheduler s = Make(1, {10});
  const Admission t1 = Admit(s, 1, Demand(3, 3, 0, {}, "chat"));
  s.PrefillDone(t1.sequence_id);
  EXPECT_FALSE(s.Finish(t1.sequence_id, true, 6, {5, 9, 20, 21, 22, 23}).release_attention);
  const std::vector<int32_t> wrong = {5, 9, 20, 7, 22, 23, 40};
  auto refused = s.Submit(2, Demand(7, 3, 0, {}, "chat"), false, wrong);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "session 'chat': context_tokens must start with the session's 6 tokens (previous "
            "context + generated tokens); position 3 differs: 7, the session has 21");
  EXPECT_EQ(s.Load().queued + s.Load().running, 0);
  const std::vector<int32_t> right = {5, 9, 20, 21, 22, 23, 40};
  auto admitted = s.Submit(3, Demand(7, 3, 0, {}, "chat"), false, right);
  ASSERT_TRUE(admitted.ok() && admitted->has_value()) << admitted.status();
  EXPECT_TRUE((*admitted)->continue_sequence);
  EXPECT_EQ((*admitted)->continued_length, 6);
  // A failed turn drops the session and its tokens: the next turn starts afresh, unchecked.
  s.PrefillDone((*admitted)->sequence_id);
  End(s, (*admitted)->sequence_id, false, 0);
  auto afresh = s.Submit(4, Demand(7, 3, 0, {}, "chat"), false, wrong);
  ASSERT_TRUE(afresh.ok() && afresh->has_value()) << afresh.status();
  EXPECT_FALSE((*afresh)->continue_sequence);
}

TEST(SchedulerTest, ASessionTurnLargerThanItsOwnWorkerIsRefusedAtOnce) {
  Scheduler s = Make(1, {4, 100});
  const Admission t1 = Admit(s, 1, Demand(100, 20, 0, {}, "chat"));  // 2 blocks
  EXPECT_EQ(t1.indexer, 0);
  s.PrefillDone(t1.sequence_id);
  End(s, t1.sequence_id, true, 120);
  // 5 blocks: indexer 1 could hold it, but the session lives on indexer 0 (4 blocks).
  auto big = s.Submit(2, Demand(300, 20, 0, {}, "chat"));
  ASSERT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("turn needs 5 index-key-cache blocks"));
  EXPECT_EQ(s.Load().queued, 0);
  // The session is not left busy.
  EXPECT_TRUE(s.Submit(3, Demand(150, 20, 0, {}, "chat")).ok());
}

// Sessions belong to their caller: another caller's request with the same session id neither
// waits on the owner's busy session nor continues its sequence; it gets a session of its own.
TEST(SchedulerTest, SessionsOfTheSameIdFromTwoCallersAreTwoSessions) {
  Scheduler s = Make(1, {100});
  SequenceDemand alice = Demand(100, 20, 0, {}, "chat");
  alice.caller = "alice";
  SequenceDemand mallory = Demand(200, 20, 0, {}, "chat");
  mallory.caller = "mallory";
  const Admission a1 = Admit(s, 1, alice);
  // alice's turn is running: the same id from mallory is not FAILED_PRECONDITION but its own.
  const Admission m1 = Admit(s, 2, mallory);
  EXPECT_FALSE(m1.continue_sequence);
  EXPECT_NE(m1.sequence_id, a1.sequence_id);
  s.PrefillDone(a1.sequence_id);
  s.PrefillDone(m1.sequence_id);
  EXPECT_FALSE(End(s, a1.sequence_id, true, 120).release_attention);
  EXPECT_FALSE(End(s, m1.sequence_id, true, 220).release_attention);
  // Each caller's next turn continues its own sequence; the lengths are checked against its own.
  alice.context_length = 150;
  const Admission a2 = Admit(s, 3, alice);
  EXPECT_TRUE(a2.continue_sequence);
  EXPECT_EQ(a2.sequence_id, a1.sequence_id);
  mallory.context_length = 150;  // shorter than mallory's 220 slots, whatever alice holds
  auto short_turn = s.Submit(4, mallory);
  EXPECT_EQ(short_turn.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_turn.status().message(), HasSubstr("session 'chat' holds 220 slots"));
  mallory.context_length = 250;
  const Admission m2 = Admit(s, 5, mallory);
  EXPECT_TRUE(m2.continue_sequence);
  EXPECT_EQ(m2.sequence_id, m1.sequence_id);
}

// The key is unambiguous: an owner that ends where another's session id begins is not that owner.
TEST(SchedulerTest, SessionKeySeparatesOwnerFromId) {
  SequenceDemand one = Demand(1, 1, 0, {}, "bc");
  one.caller = "a";
  SequenceDemand two = Demand(1, 1, 0, {}, "c");
  two.caller = "ab";
  EXPECT_NE(SessionKey(one), SessionKey(two));
  EXPECT_EQ(SessionKey(Demand(1, 1)), "");
}

TEST(SchedulerTest, AttentionWorkerWithFewestRunningAndMaxRunning) {
  Scheduler s = Make(1, {100}, /*num_attention=*/2, 4, /*max_running=*/1);
  const Admission a = Admit(s, 1, Demand(10, 1));
  const Admission b = Admit(s, 2, Demand(10, 1));
  EXPECT_EQ(a.attention, 0);
  EXPECT_EQ(b.attention, 1);
  auto c = s.Submit(3, Demand(10, 1));
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->has_value());  // both at max_running
  End(s, b.sequence_id, true, 11);
  std::vector<Admission> admitted = s.AdmitQueued();
  ASSERT_EQ(admitted.size(), 1u);
  EXPECT_EQ(admitted[0].attention, 1);
  EXPECT_THAT(s.CancelAllQueued(), ElementsAre());
}

}  // namespace
}  // namespace dsa

namespace dsa {
namespace {

// Co-located workers: indexer i lives in attention worker i, so placement pairs them, and a
// mismatch of counts is refused at creation.
TEST(SchedulerColocatedTest, ASequenceRunsOnTheAttentionWorkerThatHoldsItsIndexer) {
  SchedulerOptions options;
  options.num_full_layers = 2;
  options.max_running_per_attention = 8;
  options.colocated = true;
  // Indexer 1 has more room, so placement picks it first; attention worker 0 has fewer running
  // sequences after that, but the pair must stay (1, 1) until indexer 1 is the fuller one.
  auto scheduler = Scheduler::Create(options, {{"a0", 400}, {"a1", 4000}}, {{"a0", 0}, {"a1", 0}});
  ASSERT_TRUE(scheduler.ok()) << scheduler.status();
  for (uint64_t ticket = 1; ticket <= 6; ++ticket) {
    auto admitted = scheduler->Submit(ticket, Demand(1000, 10));
    ASSERT_TRUE(admitted.ok() && admitted->has_value()) << ticket;
    EXPECT_EQ((*admitted)->attention, (*admitted)->indexer) << "ticket " << ticket;
  }
  const absl::Status mismatch =
      Scheduler::Create(options, {{"a0", 400}}, {{"a0", 0}, {"a1", 0}}).status();
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mismatch.message()), HasSubstr("1 indexer and 2 attention workers"));
  const absl::Status misordered =
      Scheduler::Create(options, {{"a1", 400}, {"a0", 400}}, {{"a0", 0}, {"a1", 0}}).status();
  EXPECT_EQ(misordered.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(misordered.message()), HasSubstr("indexer 0 is a1"));
}

TEST(CallerWeightsTest, ParsesNameEqualsWeightAndRefusesBadEntries) {
  auto weights = ParseCallerWeights({"alice=2", "peer:10.0.0.1=3", "a=b=4"});
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->at("alice"), 2);
  EXPECT_EQ(weights->at("peer:10.0.0.1"), 3);
  EXPECT_EQ(weights->at("a=b"), 4);  // split at the last '='
  for (const char* bad : {"alice", "=2", "alice=0", "alice=x", "alice=2000000"}) {
    EXPECT_EQ(ParseCallerWeights({bad}).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(ParseCallerWeights({"a=1", "a=2"}).status().message(), HasSubstr("twice"));
}

// A caller at its queued share is refused with its own count and limit; another caller's request
// is queued and, in the fair order, admitted before the first caller's later ones.
TEST(SchedulerFairnessTest, ACallersQueuedShareAndTheFairOrder) {
  SchedulerOptions options;
  options.max_queue = 8;
  options.max_running_per_attention = 1;
  options.max_queued_per_caller = -1;  // 8 / 4 = 2
  Scheduler s = *Scheduler::Create(options, {{"i0", 1000}}, {{"a0", 0}});
  SequenceDemand a = Demand(10, 1);
  a.caller = "alice";
  SequenceDemand b = a;
  b.caller = "bob";
  auto running = s.Submit(1, a);
  ASSERT_TRUE(running.ok() && running->has_value());
  ASSERT_TRUE(s.Submit(2, a).ok());
  ASSERT_TRUE(s.Submit(3, a).ok());
  auto refused = s.Submit(4, a);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            "caller 'alice' has 2 requests queued, its limit (--max-queued-per-caller 2); retry "
            "when one of them is admitted");
  auto queued = s.Submit(5, b);
  ASSERT_TRUE(queued.ok()) << queued.status();
  EXPECT_FALSE(queued->has_value());
  s.Finish((*running)->sequence_id, /*completed=*/true, 11);
  s.ReleaseDone((*running)->sequence_id);
  std::vector<Admission> next = s.AdmitQueued();
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].ticket, 5u);  // bob's, before alice's tickets 2 and 3
  EXPECT_EQ(s.Load().queued, 2);
  EXPECT_EQ(Scheduler::Create(
                [] {
                  SchedulerOptions o;
                  o.caller_weights = {{"x", 0}};
                  return o;
                }(),
                {}, {})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dsa
