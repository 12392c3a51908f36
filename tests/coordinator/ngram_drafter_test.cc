// Tests of the n-gram prompt-lookup drafter (coordinator/ngram_drafter.h); expected drafts worked
// out by hand, and vLLM's own docstring example.
#include "coordinator/ngram_drafter.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

using Tokens = std::vector<int32_t>;

TEST(NgramDrafterTest, VllmsExampleFallsBackToTheShorterNgramAndProposesWhatFollows) {
  // vllm/v1/spec_decode/ngram_proposer.py: [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no earlier
  // occurrence, [2,3] has one at 1; only three tokens follow it.
  EXPECT_EQ(ProposeNgramDraft(Tokens{1, 2, 3, 4, 2, 3}, 4, {2, 3}), (Tokens{4, 2, 3}));
}

TEST(NgramDrafterTest, TheLongestNgramWinsOverAnEarlierShorterMatch) {
  // The last 3 tokens [7,8,9] occur at 4; the last 2 [8,9] occur earlier, at 0, but 3 > 2.
  const Tokens tokens = {8, 9, 1, 2, 7, 8, 9, 5, 6, 0, 7, 8, 9};
  EXPECT_EQ(ProposeNgramDraft(tokens, 2, {2, 4}), (Tokens{5, 6}));
  // With max_ngram 2 only [8,9] is tried: its earliest occurrence (0) is used, as vLLM does.
  EXPECT_EQ(ProposeNgramDraft(tokens, 2, {2, 2}), (Tokens{1, 2}));
}

TEST(NgramDrafterTest, AnOccurrenceMayOverlapTheSuffixButNotBeIt) {
  // [5,5,5,5]: the last 3 tokens occur at 0, overlapping the suffix at 1: the one token after
  // that occurrence is the draft. With n = 2 only, [5,5] at 0 is followed by two.
  EXPECT_EQ(ProposeNgramDraft(Tokens{5, 5, 5, 5}, 4, {2, 4}), (Tokens{5}));
  EXPECT_EQ(ProposeNgramDraft(Tokens{5, 5, 5, 5}, 4, {2, 2}), (Tokens{5, 5}));
  // [1,2]: the only occurrence of its suffix is itself: nothing to draft.
  EXPECT_TRUE(ProposeNgramDraft(Tokens{1, 2}, 4, {1, 4}).empty());
}

TEST(NgramDrafterTest, NoMatchNoBudgetOrTooShortGivesAnEmptyDraft) {
  const Tokens distinct = {1, 2, 3, 4, 5, 6};
  EXPECT_TRUE(ProposeNgramDraft(distinct, 4, {1, 4}).empty());
  const Tokens repeating = {1, 2, 3, 1, 2};
  EXPECT_EQ(ProposeNgramDraft(repeating, 4, {2, 4}), (Tokens{3, 1, 2}));
  EXPECT_TRUE(ProposeNgramDraft(repeating, 0, {2, 4}).empty());
  EXPECT_TRUE(ProposeNgramDraft(repeating, -1, {2, 4}).empty());
  EXPECT_TRUE(ProposeNgramDraft(Tokens{}, 4, {1, 4}).empty());
  EXPECT_TRUE(ProposeNgramDraft(Tokens{7}, 4, {1, 4}).empty());
  // min_ngram 3: [3,1,2] does not occur earlier, and shorter ones are not tried.
  EXPECT_TRUE(ProposeNgramDraft(repeating, 4, {3, 4}).empty());
}

TEST(NgramDrafterTest, TheDraftIsCappedAtMaxDraft) {
  const Tokens tokens = {10, 11, 12, 13, 14, 15, 16, 10, 11};
  EXPECT_EQ(ProposeNgramDraft(tokens, 4, {2, 4}), (Tokens{12, 13, 14, 15}));
  EXPECT_EQ(ProposeNgramDraft(tokens, 1, {2, 4}), (Tokens{12}));
}

TEST(NgramDrafterTest, OptionsOutOfRangeAreRefusedWithTheNumbers) {
  EXPECT_TRUE(ValidateNgramDraftOptions({2, 4}).ok());
  EXPECT_TRUE(ValidateNgramDraftOptions({1, 1}).ok());
  for (const NgramDraftOptions& bad :
       {NgramDraftOptions{0, 4}, NgramDraftOptions{3, 2}, NgramDraftOptions{1, kMaxNgram + 1}}) {
    const absl::Status status = ValidateNgramDraftOptions(bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), "n-gram lengths must satisfy 1 <= min_ngram (--ngram-min, " +
                                    std::to_string(bad.min_ngram) +
                                    ") <= max_ngram (--ngram-max, " +
                                    std::to_string(bad.max_ngram) + ") <= 64");
  }
}

}  // namespace
}  // namespace dsa
