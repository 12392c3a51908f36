// Tests of the indexer engine (indexer_service/indexer.h; DESIGN.md 4 and 5): precise statuses for
// bad requests that leave the state unchanged (checked against a fresh twin that never saw the bad
// request), positions that only move forward, and audited selects with the miss target that moves
// each sequence's rho (sparsity_controller.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "indexer_service/sparsity_controller.h"
#include "indexer_service/topk.h"
#include "tests/indexer_service/indexer_test_helpers.h"

namespace dsa::indexer_test {
namespace {

// ---------------------------------------------------------------------------------------------
// Bad requests: precise status, no state change, and the next good request answers as on a twin.

constexpr int kH = 2, kD = 8, kK = 64;
constexpr int64_t kSlots = 600;

struct Snapshot {
  std::vector<int64_t> slots;
  int64_t used_blocks, free_blocks, shared_blocks, num_sequences;
  std::vector<std::vector<float>> vertical, diagonal;
  std::vector<bool> warmup;
};

Snapshot Take(const Indexer& indexer) {
  Snapshot s;
  for (int layer = 0; layer < 2; ++layer) {
    s.slots.push_back(*indexer.NumSlots(1, layer));
    const SpinState spin = GetSpin(indexer, 1, layer);
    s.vertical.push_back(spin.vertical());
    s.diagonal.push_back(spin.diagonal());
    s.warmup.push_back(spin.warmup_pending());
  }
  const CacheUsage usage = indexer.Usage();
  s.used_blocks = usage.used_blocks;
  s.free_blocks = usage.free_blocks;
  s.shared_blocks = usage.shared_blocks;
  s.num_sequences = indexer.num_sequences();
  return s;
}

void ExpectSameSnapshot(const Snapshot& a, const Snapshot& b, const std::string& what) {
  EXPECT_EQ(a.slots, b.slots) << what;
  EXPECT_EQ(a.used_blocks, b.used_blocks) << what;
  EXPECT_EQ(a.free_blocks, b.free_blocks) << what;
  EXPECT_EQ(a.shared_blocks, b.shared_blocks) << what;
  EXPECT_EQ(a.num_sequences, b.num_sequences) << what;
  EXPECT_EQ(a.vertical, b.vertical) << what;
  EXPECT_EQ(a.diagonal, b.diagonal) << what;
  EXPECT_EQ(a.warmup, b.warmup) << what;
}

// Sequence 1: 2 layers, K = 64, rho = 0.5, 600 keys per layer (10 blocks each), warm-up pending.
// Capacity 21 blocks: one free.
std::unique_ptr<Indexer> BuildForBadRequests(bool pending_step) {
  auto indexer = MakeIndexer(21, kH, kD);
  EXPECT_TRUE(indexer->CreateSequence(1, Options(kK, 0.5, true, 2)).ok());
  std::mt19937 rng(15);
  for (int layer = 0; layer < 2; ++layer) {
    const std::vector<float> keys = RandomValues(rng, kSlots * kD);
    EXPECT_TRUE(indexer->AppendIndexKeys(1, layer, keys, kSlots).ok());
  }
  if (pending_step) {
    // Warm layer 0 up, then a 3-row step at 597..599 on layer 0 awaiting Commit.
    EXPECT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, kH, kD), 596).ok());
    std::vector<Query> qs;
    std::vector<IndexerRow> rows;
    for (int r = 0; r < 3; ++r) qs.push_back(RandomQuery(rng, kH, kD));
    for (int r = 0; r < 3; ++r) rows.push_back({qs[r].query, qs[r].weights, 597 + r});
    EXPECT_TRUE(indexer->Select(1, 0, rows).ok());
  }
  return indexer;
}

absl::Status Append(Indexer& indexer, uint64_t id, int layer, int64_t num_keys, size_t values,
                    float poison = 0.0f);

// The good request after each bad one: one row at 599 on each layer (with pending_step: Commit(1)
// first), compared field by field with the twin.
void ExpectSameAnswerAsTwin(Indexer& indexer, Indexer& twin, bool pending_step,
                            const std::string& what) {
  if (pending_step) {
    ASSERT_TRUE(indexer.Commit(1, 1).ok()) << what;
    ASSERT_TRUE(twin.Commit(1, 1).ok()) << what;
  }
  std::mt19937 rng(16);
  for (int layer = 0; layer < 2; ++layer) {
    const Query q = RandomQuery(rng, kH, kD);
    if (pending_step) {  // Commit(1) keeps 597 + 1 + 1 slots: the next decode key goes to 599
      ASSERT_TRUE(Append(indexer, 1, layer, 1, kD).ok()) << what;
      ASSERT_TRUE(Append(twin, 1, layer, 1, kD).ok()) << what;
    }
    const int64_t position = 599;
    auto got = SelectOne(indexer, 1, layer, q, position);
    auto want = SelectOne(twin, 1, layer, q, position);
    ASSERT_TRUE(got.ok()) << what << ": " << got.status();
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(got->selections, want->selections) << what << " layer " << layer;
    EXPECT_EQ(got->blocks, want->blocks) << what << " layer " << layer;
    EXPECT_EQ(got->all_blocks, want->all_blocks) << what << " layer " << layer;
  }
  ExpectSameSnapshot(Take(indexer), Take(twin), what + " (after the good request)");
}

struct BadRequest {
  std::string name;
  StatusCode code;
  std::function<absl::Status(Indexer&)> call;
};

absl::Status SelectRows(Indexer& indexer, uint64_t id, int layer, std::vector<int64_t> positions,
                        std::function<void(std::vector<Query>&)> spoil = nullptr) {
  std::mt19937 rng(17);
  std::vector<Query> qs;
  for (size_t r = 0; r < positions.size(); ++r) qs.push_back(RandomQuery(rng, kH, kD));
  if (spoil) spoil(qs);
  std::vector<IndexerRow> rows;
  for (size_t r = 0; r < positions.size(); ++r)
    rows.push_back({qs[r].query, qs[r].weights, positions[r]});
  return indexer.Select(id, layer, rows).status();
}

absl::Status Append(Indexer& indexer, uint64_t id, int layer, int64_t num_keys, size_t values,
                    float poison) {
  std::mt19937 rng(18);
  std::vector<float> keys = RandomValues(rng, values);
  if (poison != 0.0f && !keys.empty()) keys[keys.size() / 2] = poison;
  return indexer.AppendIndexKeys(id, layer, keys, num_keys);
}

std::vector<BadRequest> BadRequestsWithoutPendingStep() {
  return {
      {"query too short", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].query.pop_back(); });
       }},
      {"query too long", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].query.push_back(1.0f); });
       }},
      {"weights too short", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].weights.pop_back(); });
       }},
      {"NaN in query", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].query[3] = kNaN; });
       }},
      {"inf in weights", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].weights[1] = kInf; });
       }},
      {"NaN in the last verifier row", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {597, 598, 599}, [](auto& q) { q[2].query[0] = kNaN; });
       }},
      {"no rows", StatusCode::kInvalidArgument, [](Indexer& x) { return SelectRows(x, 1, 0, {}); }},
      {"equal positions", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {598, 598});
       }},
      {"decreasing positions", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599, 598});
       }},
      {"verifier rows not ending at the newest slot", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {10, 11, 12});
       }},
      {"verifier rows with a gap", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {597, 599});
       }},
      {"append with a wrapping key count", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 0, (int64_t{1} << 61) + 1, 8); }},
      {"negative position", StatusCode::kInvalidArgument,
       [](Indexer& x) { return SelectRows(x, 1, 0, {-1}); }},
      {"position at the slot count", StatusCode::kOutOfRange,
       [](Indexer& x) { return SelectRows(x, 1, 0, {600}); }},
      {"last verifier row beyond slots", StatusCode::kOutOfRange,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {598, 599, 600});
       }},
      {"select layer out of range", StatusCode::kInvalidArgument,
       [](Indexer& x) { return SelectRows(x, 1, 2, {599}); }},
      {"select unknown sequence", StatusCode::kNotFound,
       [](Indexer& x) { return SelectRows(x, 7, 0, {599}); }},
      {"NaN in keys", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 0, 4, 4 * kD, kNaN); }},
      {"inf in keys", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 1, 4, 4 * kD, -kInf); }},
      {"key shape", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 0, 4, 4 * kD - 1); }},
      {"append layer out of range", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, -1, 1, kD); }},
      {"append unknown sequence", StatusCode::kNotFound,
       [](Indexer& x) { return Append(x, 7, 0, 1, kD); }},
      {"pool full", StatusCode::kResourceExhausted,
       [](Indexer& x) { return Append(x, 1, 0, 129, 129 * kD); }},
      {"duplicate sequence", StatusCode::kAlreadyExists,
       [](Indexer& x) { return x.CreateSequence(1, Options(16, 0.0, false, 1)); }},
      {"duplicate sequence from prefix", StatusCode::kAlreadyExists,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(1, Options(kK, 0.5, true, 2), 1, 64); }},
      {"rho 1", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequence(2, Options(kK, 1.0)); }},
      {"rho negative", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequence(2, Options(kK, -0.25)); }},
      {"decay 1", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         SequenceOptions o = Options(kK, 0.5);
         o.spin.ema_decay = 1.0;
         return x.CreateSequence(2, o);
       }},
      {"decay negative", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         SequenceOptions o = Options(kK, 0.5);
         o.spin.ema_decay = -0.1;
         return x.CreateSequence(2, o);
       }},
      {"prefix not a multiple of 64", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 2), 1, 100); }},
      {"prefix longer than the source", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 2), 1, 640); }},
      {"prefix layer count", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 1), 1, 64); }},
      {"prefix unknown source", StatusCode::kNotFound,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 2), 9, 64); }},
      {"commit with nothing pending", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return x.Commit(1, 0); }},
      {"commit unknown sequence", StatusCode::kNotFound, [](Indexer& x) { return x.Commit(7, 0); }},
      {"begin turn unknown sequence", StatusCode::kNotFound,
       [](Indexer& x) { return x.BeginTurn(7); }},
      {"release unknown sequence", StatusCode::kNotFound, [](Indexer& x) { return x.Release(7); }},
  };
}

std::vector<BadRequest> BadRequestsWithPendingStep() {
  return {
      {"accepted above d", StatusCode::kOutOfRange, [](Indexer& x) { return x.Commit(1, 3); }},
      {"accepted negative", StatusCode::kOutOfRange, [](Indexer& x) { return x.Commit(1, -1); }},
      {"share the prefix of a sequence with a pending step", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(9, Options(kK, 0.5, true, 2), 1, 64); }},
      {"append to the pending layer", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return Append(x, 1, 0, 1, kD); }},
      {"begin turn while pending", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return x.BeginTurn(1); }},
      {"select the pending layer again", StatusCode::kFailedPrecondition,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {597, 598, 599});
       }},
      {"other layer, other row count", StatusCode::kInvalidArgument,
       [](Indexer& x) { return SelectRows(x, 1, 1, {599}); }},
      {"other layer, other first position", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 1, {596, 597, 598});
       }},
      {"bad row on the other layer", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 1, {597, 598, 599}, [](auto& q) { q[1].weights[0] = kNaN; });
       }},
  };
}

void RunBadRequests(bool pending_step, const std::vector<BadRequest>& requests) {
  for (const BadRequest& request : requests) {
    SCOPED_TRACE(request.name);
    auto indexer = BuildForBadRequests(pending_step);
    auto twin = BuildForBadRequests(pending_step);
    const Snapshot before = Take(*indexer);
    ExpectSameSnapshot(before, Take(*twin), "twin before");
    const absl::Status status = request.call(*indexer);
    EXPECT_EQ(status.code(), request.code) << status;
    ExpectSameSnapshot(before, Take(*indexer), "state after the bad request");
    ExpectSameAnswerAsTwin(*indexer, *twin, pending_step, request.name);
  }
}

TEST(IndexerBadRequestTest, PreciseStatusAndNoStateChange) {
  RunBadRequests(false, BadRequestsWithoutPendingStep());
}

TEST(IndexerBadRequestTest, PreciseStatusAndNoStateChangeWhileAStepIsPending) {
  RunBadRequests(true, BadRequestsWithPendingStep());
}

TEST(IndexerBadRequestTest, GoodRequestsStillChangeState) {
  // The twin comparison must be able to fail: a request that does change state (a select past the
  // warm-up) makes the snapshots differ.
  auto indexer = BuildForBadRequests(false);
  const Snapshot before = Take(*indexer);
  ASSERT_TRUE(SelectRows(*indexer, 1, 0, {599}).ok());
  const Snapshot after = Take(*indexer);
  EXPECT_NE(before.warmup, after.warmup);
  EXPECT_NE(before.vertical, after.vertical);
}

TEST(IndexerTest, PositionsOnlyMoveForward) {
  // A second select at the same (or an earlier) position would update the EMAs twice.
  const int H = 2, D = 8, K = 64;
  auto indexer = MakeIndexer(20, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5)).ok());
  std::mt19937 rng(21);
  const std::vector<float> keys = RandomValues(rng, 1000 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 1000).ok());
  ASSERT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 999).ok());
  const SpinState before = GetSpin(*indexer, 1, 0);
  EXPECT_EQ(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 999).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 100).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(GetSpin(*indexer, 1, 0).vertical(), before.vertical());
  EXPECT_EQ(GetSpin(*indexer, 1, 0).diagonal(), before.diagonal());
}

TEST(IndexerTest, AuditedSelectsReportTheMissRateAgainstTheDenseTopKAndChangeNothing) {
  // audit_fraction = 1: every pruned select is audited. The audited miss rate equals the one
  // computed from an all-keep twin sequence's selection (the dense top-K of the same row), the
  // warm-up (all blocks scored) is not audited, and the EMAs equal an engine without the audit.
  const int H = 2, D = 8, K = 64;
  IndexerOptions options{.capacity_blocks = 120, .num_heads = H, .head_dim = D};
  auto plain = *Indexer::Create(options);
  options.audit_fraction = 1.0;
  options.audit_seed = 5;
  auto audited = *Indexer::Create(options);
  std::mt19937 rng(23);
  const std::vector<float> keys = RandomValues(rng, 2010 * D);
  for (Indexer* x : {plain.get(), audited.get()}) {
    ASSERT_TRUE(x->CreateSequence(1, Options(K, 0.6, true, 1, 0.0)).ok());
    ASSERT_TRUE(x->CreateSequence(2, Options(K, 0.6, /*enabled=*/false)).ok());
    for (uint64_t id : {1, 2}) {
      ASSERT_TRUE(
          x->AppendIndexKeys(id, 0, std::span<const float>(keys.data(), 2000 * D), 2000).ok());
    }
  }
  int audited_steps = 0;
  double total_miss = 0;
  for (int64_t t = 1999; t < 2009; ++t) {
    if (t > 1999) {
      for (Indexer* x : {plain.get(), audited.get()}) {
        for (uint64_t id : {1, 2}) {
          ASSERT_TRUE(
              x->AppendIndexKeys(id, 0, std::span<const float>(keys.data() + t * D, D), 1).ok());
        }
      }
    }
    const Query q = RandomQuery(rng, H, D);
    auto a = SelectOne(*audited, 1, 0, q, t, false);
    auto p = SelectOne(*plain, 1, 0, q, t, false);
    auto dense = SelectOne(*audited, 2, 0, q, t, false);
    ASSERT_TRUE(a.ok() && p.ok() && dense.ok());
    EXPECT_EQ(a->selections, p->selections);
    EXPECT_TRUE(p->audit_miss_rates.empty());
    if (a->all_blocks) {
      EXPECT_TRUE(a->audit_miss_rates.empty()) << "warm-up at " << t;
      continue;
    }
    ++audited_steps;
    ASSERT_EQ(a->audit_miss_rates.size(), 1u);
    EXPECT_DOUBLE_EQ(a->audit_miss_rates[0], SelectionMissRate(a->selections, dense->selections));
    total_miss += a->audit_miss_rates[0];
  }
  EXPECT_EQ(audited_steps, 9);
  EXPECT_GT(total_miss, 0.0);  // rho = 0.6 on random keys loses some of the dense top-K
  EXPECT_EQ(GetSpin(*audited, 1, 0).vertical(), GetSpin(*plain, 1, 0).vertical());
  EXPECT_EQ(GetSpin(*audited, 1, 0).diagonal(), GetSpin(*plain, 1, 0).diagonal());
}

// Adaptive sparsity (sparsity_controller.h): each select plans with the rho the controller left
// after the selects before it, replayed here from their audited miss rates; a target that audits
// always exceed moves rho down, one they never reach moves it up, and at rho 0 a select over more
// than K slots counts as a miss of 0. The indexer's default target applies to a sequence that
// names none.
TEST(IndexerTest, AMissTargetMovesEachSequencesRhoFromItsAuditedMissRates) {
  const int H = 2, D = 8, K = 64;
  IndexerOptions options{.capacity_blocks = 160, .num_heads = H, .head_dim = D};
  options.audit_fraction = 1.0;
  options.miss_target = 0.99;  // for sequence 4, which names none: audits never exceed it
  auto indexer = *Indexer::Create(options);
  SequenceOptions strict = Options(K, 0.6, true, 1, 0.0);
  strict.spin.miss_target = 0.001;
  SequenceOptions loose = Options(K, 0.2, true, 1, 0.0);
  loose.spin.miss_target = 0.99;
  SequenceOptions from_zero = Options(K, 0.0, true, 1, 0.0);
  from_zero.spin.miss_target = 0.5;
  const SequenceOptions by_default = Options(K, 0.3, true, 1, 0.0);
  std::mt19937 rng(29);
  const std::vector<float> keys = RandomValues(rng, 2010 * D);
  const std::vector<std::pair<uint64_t, SequenceOptions>> sequences = {
      {1, strict}, {2, loose}, {3, from_zero}, {4, by_default}};
  for (const auto& [id, o] : sequences) {
    ASSERT_TRUE(indexer->CreateSequence(id, o).ok());
    ASSERT_TRUE(
        indexer->AppendIndexKeys(id, 0, std::span<const float>(keys.data(), 2000 * D), 2000).ok());
  }
  std::map<uint64_t, double> rho = {{1, 0.6}, {2, 0.2}, {3, 0.0}, {4, 0.3}};
  const std::map<uint64_t, double> target = {{1, 0.001}, {2, 0.99}, {3, 0.5}, {4, 0.99}};
  int strict_misses = 0;
  for (int64_t t = 1999; t < 2009; ++t) {
    const Query q = RandomQuery(rng, H, D);
    for (const auto& [id, o] : sequences) {
      if (t > 1999) {
        ASSERT_TRUE(
            indexer->AppendIndexKeys(id, 0, std::span<const float>(keys.data() + t * D, D), 1)
                .ok());
      }
      auto result = SelectOne(*indexer, id, 0, q, t, false);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_NEAR(result->target_block_sparsity, rho[id], 1e-12) << id << " at " << t;
      EXPECT_TRUE(result->spin);
      if (!result->all_blocks) {
        // SPIN planned with that rho: m_t blocks (gamma 0).
        EXPECT_EQ(result->blocks_scored,
                  SpinState::BlockBudget(result->blocks_visible, K, rho[id]));
      }
      if (!result->audit_miss_rates.empty()) {
        const double miss = result->audit_miss_rates[0];
        if (id == 1 && miss > target.at(1)) ++strict_misses;
        rho[id] = NextTargetSparsity(rho[id], miss, target.at(id));
      } else if (result->all_blocks && rho[id] == 0) {
        rho[id] = NextTargetSparsity(rho[id], 0.0, target.at(id));
      }
    }
  }
  EXPECT_GE(strict_misses, 3);                 // random keys: a strict target is missed often...
  EXPECT_LT(rho[1], 0.6 - 0.05 * 2);           // ...and rho came down
  EXPECT_NEAR(rho[2], 0.2 + 0.01 * 9, 1e-12);  // 9 audited selects after the warm-up, all below
  EXPECT_GT(rho[3], 0.0);                      // rose from 0
  EXPECT_NEAR(rho[4], 0.3 + 0.01 * 9, 1e-12);  // the indexer's default target
}

TEST(IndexerTest, AMissTargetWithoutAuditsIsRefused) {
  IndexerOptions options{.capacity_blocks = 4, .num_heads = 2, .head_dim = 4};
  options.miss_target = 0.05;
  const auto unaudited = Indexer::Create(options);
  EXPECT_EQ(unaudited.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unaudited.status().message().find("audit_fraction"), std::string::npos);
  options.miss_target = 1.0;
  options.audit_fraction = 0.5;
  EXPECT_EQ(Indexer::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.miss_target = 0;
  options.audit_fraction = 0;
  auto indexer = *Indexer::Create(options);
  SequenceOptions sequence = Options(64, 0.4);
  sequence.spin.miss_target = 0.05;
  const absl::Status refused = indexer->CreateSequence(1, sequence);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("--audit-fraction"), std::string::npos) << refused;
  sequence.spin.miss_target = 1.5;
  const absl::Status out_of_range = indexer->CreateSequence(1, sequence);
  EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_range.message().find("miss target"), std::string::npos) << out_of_range;
  // All-keep needs no audits: its target is moot.
  SequenceOptions all_keep = Options(64, 0.4, /*enabled=*/false);
  all_keep.spin.miss_target = 0.05;
  EXPECT_TRUE(indexer->CreateSequence(2, all_keep).ok());
}

TEST(SparsityControllerTest, StepsDownAboveTheTargetAndUpOtherwiseWithinItsBounds) {
  EXPECT_NEAR(NextTargetSparsity(0.4, 0.10, 0.05), 0.4 - kSparsityDecrease, 1e-12);
  EXPECT_NEAR(NextTargetSparsity(0.4, 0.05, 0.05), 0.4 + kSparsityIncrease, 1e-12);  // at: up
  EXPECT_NEAR(NextTargetSparsity(0.4, 0.0, 0.05), 0.41, 1e-12);
  EXPECT_EQ(NextTargetSparsity(0.02, 0.9, 0.05), 0.0);
  EXPECT_EQ(NextTargetSparsity(kMaxAdaptiveSparsity, 0.0, 0.05), kMaxAdaptiveSparsity);
}

TEST(IndexerTest, AuditFractionOutsideTheUnitIntervalIsRefused) {
  for (double fraction : {-0.1, 1.5, std::nan("")}) {
    IndexerOptions options{.capacity_blocks = 4, .num_heads = 2, .head_dim = 4};
    options.audit_fraction = fraction;
    EXPECT_EQ(Indexer::Create(options).status().code(), StatusCode::kInvalidArgument) << fraction;
  }
}

}  // namespace
}  // namespace dsa::indexer_test
