// The indexer service's CPU scoring of the real SmolLM2-135M indexer inputs (trained
// weights, held-out tokens) equals the double-precision reference of docs/model.md over fp8 keys.
// Fails, naming scripts/model_setup.sh, when the model files are missing.
#include <memory>

#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "tests/attention_worker/llama_indexer_scores_check.h"

namespace dsa {
namespace {

TEST(LlamaIndexerScoresTest, CpuScoresAndSelectionsEqualTheReferenceOfTheTrainedWeights) {
  const auto& inputs = indexer_scores_check::Inputs(/*read_file=*/false);
  ASSERT_FALSE(inputs.layers.empty()) << "the model inputs could not be computed (see above)";
  auto indexer = Indexer::Create({.capacity_blocks = 256, .num_heads = 16, .head_dim = 64});
  ASSERT_TRUE(indexer.ok()) << indexer.status();
  indexer_scores_check::CheckIndexer(**indexer, /*bf16_queries=*/false,
                                     /*expect_on_device=*/false, "cpu");
}

}  // namespace
}  // namespace dsa
