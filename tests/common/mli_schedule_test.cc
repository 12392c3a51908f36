// Tests of the MLI layer schedule with IndexCache retention (common/mli_schedule.h, DESIGN.md 4.3).
// Expected schedules are worked out by hand from sigma(l) = pi_k(p(l)), or by a naive reference
// written here for the seeded random patterns.
#include "common/mli_schedule.h"

#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// The attended layer of each layer, in order.
std::vector<int> AttendedLayers(const MliSchedule& schedule) {
  std::vector<int> attended;
  for (int l = 0; l < schedule.num_layers(); ++l) attended.push_back(schedule.AttendedLayer(l));
  return attended;
}

MliSchedule MustFromPattern(std::string_view pattern, int lag_depth) {
  absl::StatusOr<MliSchedule> schedule = MliSchedule::FromPattern(pattern, lag_depth);
  EXPECT_TRUE(schedule.ok()) << schedule.status();
  return *std::move(schedule);
}

TEST(MliScheduleTest, LagZeroAttendsNearestFullLayer) {
  const MliSchedule s = MustFromPattern("FSSSFSSS", 0);
  EXPECT_EQ(s.num_layers(), 8);
  EXPECT_EQ(s.lag_depth(), 0);
  EXPECT_THAT(s.full_layers(), ElementsAre(0, 4));
  EXPECT_THAT(AttendedLayers(s), ElementsAre(0, 0, 0, 0, 4, 4, 4, 4));
  EXPECT_THAT(s.Consumers(0), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(s.Consumers(4), ElementsAre(4, 5, 6, 7));
  EXPECT_EQ(s.DeadlineLayer(0), 0);
  EXPECT_EQ(s.DeadlineLayer(4), 4);
  for (int l = 0; l < 8; ++l) EXPECT_EQ(s.NearestFullLayer(l), l < 4 ? 0 : 4) << l;
  EXPECT_TRUE(s.is_full(0));
  EXPECT_FALSE(s.is_full(1));
  EXPECT_TRUE(s.is_full(4));
  EXPECT_FALSE(s.is_full(7));
}

TEST(MliScheduleTest, LagOneAttendsPreviousFullLayer) {
  // F = {0, 4}. Layers 4..7: p = 4, one full layer back is 0. Layers 0..3: p = 0 is the first full
  // layer, which has no predecessor, so it and its shared layers attend their own (0).
  const MliSchedule s = MustFromPattern("FSSSFSSS", 1);
  EXPECT_THAT(AttendedLayers(s), ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(s.Consumers(0), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_THAT(s.Consumers(4), IsEmpty());  // the last full layer's selection is unused at k = 1
  EXPECT_EQ(s.DeadlineLayer(0), 0);
  EXPECT_EQ(s.DeadlineLayer(4), -1);
}

TEST(MliScheduleTest, LagTwoOnAlternatingPattern) {
  // F = {0, 2, 4, 6}; p(l) = l rounded down to even. Ranks 0 and 1 (layers 0..3) attend their own;
  // layers 4, 5 (rank 2) attend rank 0 = layer 0; layers 6, 7 (rank 3) attend rank 1 = layer 2.
  const MliSchedule s = MustFromPattern("FSFSFSFS", 2);
  EXPECT_THAT(AttendedLayers(s), ElementsAre(0, 0, 2, 2, 0, 0, 2, 2));
  EXPECT_THAT(s.Consumers(0), ElementsAre(0, 1, 4, 5));
  EXPECT_THAT(s.Consumers(2), ElementsAre(2, 3, 6, 7));
  EXPECT_THAT(s.Consumers(4), IsEmpty());
  EXPECT_THAT(s.Consumers(6), IsEmpty());
  EXPECT_EQ(s.DeadlineLayer(0), 0);
  EXPECT_EQ(s.DeadlineLayer(2), 2);
  EXPECT_EQ(s.DeadlineLayer(4), -1);
  EXPECT_EQ(s.DeadlineLayer(6), -1);
}

TEST(MliScheduleTest, LagOneOnAllFullLayers) {
  // Every layer is full: layer l attends l - 1, layer 0 its own.
  const MliSchedule s = MustFromPattern("FFFF", 1);
  EXPECT_THAT(AttendedLayers(s), ElementsAre(0, 0, 1, 2));
  EXPECT_THAT(s.Consumers(0), ElementsAre(0, 1));
  EXPECT_THAT(s.Consumers(1), ElementsAre(2));
  EXPECT_THAT(s.Consumers(2), ElementsAre(3));
  EXPECT_THAT(s.Consumers(3), IsEmpty());
  EXPECT_EQ(s.DeadlineLayer(1), 2);
  EXPECT_EQ(s.DeadlineLayer(3), -1);
}

TEST(MliScheduleTest, LagThreeOnIrregularPattern) {
  // F = {0, 2, 3, 6, 7} (ranks 0..4). p(l): 0 0 2 3 3 3 6 7, ranks 0 0 1 2 2 2 3 4.
  // Ranks 0..2 attend their own; rank 3 (layer 6) attends rank 0 = 0; rank 4 (layer 7) rank 1 = 2.
  const MliSchedule s = MustFromPattern("FSFFSSFF", 3);
  EXPECT_THAT(s.full_layers(), ElementsAre(0, 2, 3, 6, 7));
  EXPECT_THAT(AttendedLayers(s), ElementsAre(0, 0, 2, 3, 3, 3, 0, 2));
  EXPECT_THAT(s.Consumers(0), ElementsAre(0, 1, 6));
  EXPECT_THAT(s.Consumers(2), ElementsAre(2, 7));
  EXPECT_THAT(s.Consumers(3), ElementsAre(3, 4, 5));
  EXPECT_THAT(s.Consumers(6), IsEmpty());
  EXPECT_EQ(s.DeadlineLayer(3), 3);
}

TEST(MliScheduleTest, LagDeeperThanFullLayerCountAttendsOwn) {
  const MliSchedule s = MustFromPattern("FSSSFSSS", 5);
  EXPECT_THAT(AttendedLayers(s), ElementsAre(0, 0, 0, 0, 4, 4, 4, 4));
}

TEST(MliScheduleTest, SingleLayer) {
  const MliSchedule s = MustFromPattern("F", 2);
  EXPECT_THAT(AttendedLayers(s), ElementsAre(0));
  EXPECT_THAT(s.Consumers(0), ElementsAre(0));
  EXPECT_EQ(s.Pattern(), "F");
}

TEST(MliScheduleTest, ConsumersOfSharedOrOutOfRangeLayerAreEmpty) {
  const MliSchedule s = MustFromPattern("FSSSFSSS", 0);
  EXPECT_THAT(s.Consumers(1), IsEmpty());
  EXPECT_THAT(s.Consumers(-1), IsEmpty());
  EXPECT_THAT(s.Consumers(8), IsEmpty());
  EXPECT_EQ(s.DeadlineLayer(5), -1);
  EXPECT_EQ(s.DeadlineLayer(100), -1);
}

TEST(MliScheduleTest, RetentionFourOverEightLayersEqualsPattern) {
  absl::StatusOr<MliSchedule> s = MliSchedule::FromRetention(8, 4, 1);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->Pattern(), "FSSSFSSS");
  EXPECT_THAT(s->full_layers(), ElementsAre(0, 4));
  EXPECT_EQ(s->lag_depth(), 1);
  EXPECT_THAT(AttendedLayers(*s), ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));
}

TEST(MliScheduleTest, OtherRetentionStrides) {
  absl::StatusOr<MliSchedule> r3 = MliSchedule::FromRetention(8, 3, 0);
  ASSERT_TRUE(r3.ok());
  EXPECT_EQ(r3->Pattern(), "FSSFSSFS");
  absl::StatusOr<MliSchedule> r1 = MliSchedule::FromRetention(5, 1, 2);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->Pattern(), "FFFFF");
  EXPECT_THAT(AttendedLayers(*r1), ElementsAre(0, 1, 0, 1, 2));
  absl::StatusOr<MliSchedule> r10 = MliSchedule::FromRetention(8, 10, 0);
  ASSERT_TRUE(r10.ok());
  EXPECT_EQ(r10->Pattern(), "FSSSSSSS");
  // 61 layers at r = 2: the even layers are full.
  absl::StatusOr<MliSchedule> r2 = MliSchedule::FromRetention(61, 2, 1);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->full_layers().size(), 31u);
  EXPECT_EQ(r2->AttendedLayer(60), 58);
  EXPECT_EQ(r2->AttendedLayer(59), 56);
  EXPECT_EQ(r2->AttendedLayer(1), 0);
}

void ExpectInvalidArgument(const absl::Status& status, std::string_view substring) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(std::string(substring))) << status;
}

TEST(MliScheduleTest, PatternStartingWithSharedLayerIsRejected) {
  ExpectInvalidArgument(MliSchedule::FromPattern("SFFF", 0).status(), "shared");
  ExpectInvalidArgument(MliSchedule::FromPattern("S", 1).status(), "shared");
}

TEST(MliScheduleTest, PatternLengthMustMatchExpectedLayers) {
  ExpectInvalidArgument(MliSchedule::FromPattern("FSSS", 0, 8).status(), "8");
  ExpectInvalidArgument(MliSchedule::FromPattern("FSSSFSSSF", 0, 8).status(), "9");
  EXPECT_TRUE(MliSchedule::FromPattern("FSSSFSSS", 0, 8).ok());
  EXPECT_TRUE(MliSchedule::FromPattern("FSSS", 0, -1).ok());  // -1 skips the check
}

TEST(MliScheduleTest, BadCharactersAreRejected) {
  ExpectInvalidArgument(MliSchedule::FromPattern("FSXS", 0).status(), "X");
  ExpectInvalidArgument(MliSchedule::FromPattern("fsss", 0).status(), "f");
  ExpectInvalidArgument(MliSchedule::FromPattern("FS S", 0).status(), "'F' or 'S'");
  ExpectInvalidArgument(MliSchedule::FromPattern(std::string_view("FS\0S", 4), 0).status(),
                        "'F' or 'S'");
}

TEST(MliScheduleTest, EmptyPatternIsRejected) {
  ExpectInvalidArgument(MliSchedule::FromPattern("", 0).status(), "empty");
  ExpectInvalidArgument(MliSchedule::FromPattern("", 0, 0).status(), "empty");
}

TEST(MliScheduleTest, NegativeLagDepthIsRejected) {
  ExpectInvalidArgument(MliSchedule::FromPattern("FSSS", -1).status(), "lag depth");
  ExpectInvalidArgument(MliSchedule::FromRetention(8, 4, -1).status(), "lag depth");
}

TEST(MliScheduleTest, RetentionStrideBelowOneIsRejected) {
  ExpectInvalidArgument(MliSchedule::FromRetention(8, 0, 0).status(), "retention");
  ExpectInvalidArgument(MliSchedule::FromRetention(8, -3, 0).status(), "retention");
}

TEST(MliScheduleTest, NumLayersBelowOneIsRejected) {
  ExpectInvalidArgument(MliSchedule::FromRetention(0, 1, 0).status(), "num_layers");
  ExpectInvalidArgument(MliSchedule::FromRetention(-5, 1, 0).status(), "num_layers");
}

// Naive sigma(l): walk back to p(l), then back over k more full layers; if there are fewer than k
// full layers before p(l), p(l) itself.
int ReferenceAttendedLayer(const std::string& pattern, int lag_depth, int layer) {
  int p = layer;
  while (pattern[p] != 'F') --p;
  int found = 0, candidate = p;
  for (int l = p - 1; l >= 0 && found < lag_depth; --l) {
    if (pattern[l] == 'F') {
      ++found;
      candidate = l;
    }
  }
  return found == lag_depth ? candidate : p;
}

TEST(MliScheduleTest, RandomPatternsNeverAttendAnUninitializedSelection) {
  std::mt19937 rng(12345);  // mt19937's sequence is fixed by the standard
  std::uniform_int_distribution<int> length_dist(1, 64);
  std::bernoulli_distribution full_dist(0.35);
  for (int trial = 0; trial < 300; ++trial) {
    std::string pattern(length_dist(rng), 'S');
    pattern[0] = 'F';
    for (size_t l = 1; l < pattern.size(); ++l) pattern[l] = full_dist(rng) ? 'F' : 'S';
    for (int k = 0; k <= 3; ++k) {
      absl::StatusOr<MliSchedule> s =
          MliSchedule::FromPattern(pattern, k, static_cast<int>(pattern.size()));
      ASSERT_TRUE(s.ok()) << pattern << " " << s.status();
      EXPECT_EQ(s->Pattern(), pattern);
      std::vector<int> consumer_count(pattern.size(), 0);
      for (int l = 0; l < static_cast<int>(pattern.size()); ++l) {
        const int attended = s->AttendedLayer(l);
        // Attends a full layer at or before itself: its selection exists by the time l runs.
        ASSERT_GE(attended, 0) << pattern << " k=" << k << " l=" << l;
        ASSERT_LE(attended, l) << pattern << " k=" << k << " l=" << l;
        EXPECT_EQ(pattern[attended], 'F') << pattern << " k=" << k << " l=" << l;
        EXPECT_EQ(attended, ReferenceAttendedLayer(pattern, k, l))
            << pattern << " k=" << k << " l=" << l;
        ++consumer_count[attended];
      }
      // Consumers() partitions the layers by attended layer.
      for (int f = 0; f < static_cast<int>(pattern.size()); ++f) {
        const std::vector<int> consumers = s->Consumers(f);
        EXPECT_EQ(static_cast<int>(consumers.size()), consumer_count[f]) << pattern << " f=" << f;
        for (int c : consumers) EXPECT_EQ(ReferenceAttendedLayer(pattern, k, c), f);
        EXPECT_EQ(s->DeadlineLayer(f), consumers.empty() ? -1 : consumers.front());
      }
    }
  }
}

}  // namespace
}  // namespace dsa
