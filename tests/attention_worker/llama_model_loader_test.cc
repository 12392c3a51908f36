// Tests of the real model's files: the safetensors reader (crafted good and broken files) and the
// loader's checks, each error naming the file and what was expected, over the tiny model's files
// (llama_model_test_helpers.h).
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/llama_model.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/attention_worker/llama_model_test_helpers.h"

namespace dsa {
namespace {

using namespace ::dsa::llama_model_testing;  // NOLINT(google-build-using-namespace)

using ::testing::AllOf;
using ::testing::HasSubstr;

// ---- safetensors ----

TEST(Safetensors, RoundTrip) {
  const std::string path = TempPath("round_trip.safetensors");
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<std::byte> a_bytes = FloatBytes(a);
  const std::vector<std::byte> b_bytes = {std::byte{7}, std::byte{8}};
  const SafetensorsTensorToWrite tensors[] = {{"a", "F32", {2, 3}, a_bytes},
                                              {"b", "U8", {2}, b_bytes}};
  ASSERT_TRUE(WriteSafetensors(path, {{"key", "value"}}, tensors).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("key"), "value");
  ASSERT_EQ((*file)->tensors().size(), 2u);
  const SafetensorsTensor* tensor = (*file)->Find("a");
  ASSERT_NE(tensor, nullptr);
  EXPECT_EQ(tensor->dtype, "F32");
  EXPECT_EQ(tensor->shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(tensor->bytes.size(), 24u);
  // The round trip keeps the bytes themselves, whatever floats they hold.
  // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
  EXPECT_EQ(std::memcmp(tensor->bytes.data(), a.data(), 24), 0);
  EXPECT_EQ((*file)->Find("b")->bytes[1], std::byte{8});
  EXPECT_EQ((*file)->Find("c"), nullptr);
  file->reset();
  std::filesystem::remove(path);
}

TEST(Safetensors, MissingFileIsNotFound) {
  const std::string path = TempPath("does_not_exist.safetensors");
  const auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
}

TEST(Safetensors, TruncatedFileIsDataLossWithBothSizes) {
  const std::string path = TempPath("truncated.safetensors");
  const std::vector<std::byte> bytes = FloatBytes(std::vector<float>(100, 1.0f));
  const SafetensorsTensorToWrite tensors[] = {{"x", "F32", {100}, bytes}};
  ASSERT_TRUE(WriteSafetensors(path, {}, tensors).ok());
  const uint64_t full = std::filesystem::file_size(path);
  Truncate(path, full - 10);
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(),
              AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr(absl::StrCat(full - 10)),
                    HasSubstr(absl::StrCat("expected ", full))));
  // Inside the header, and shorter than the length field.
  Truncate(path, 20);
  EXPECT_EQ(SafetensorsFile::Open(path).status().code(), absl::StatusCode::kDataLoss);
  Truncate(path, 5);
  file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr("at least 8")));
  std::filesystem::remove(path);
}

TEST(Safetensors, MalformedHeadersAreInvalidArgument) {
  const std::string path = TempPath("malformed.safetensors");
  const std::string eight(8, 'x');
  struct Case {
    std::string header, data, expected;
  };
  const Case cases[] = {
      {"not json", "", "not a JSON object"},
      {"[1, 2]", "", "not a JSON object"},
      {R"({"x": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", eight,
       "unknown dtype \"F33\""},
      {R"({"x": {"shape": [2], "data_offsets": [0, 8]}})", eight, "no string \"dtype\""},
      {R"({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", eight,
       "not an integer >= 0"},
      {R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", eight, "end < begin"},
      {R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", eight,
       "spans 8 bytes but F32 [3] needs 12"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "y": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})",
       eight, "overlap"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", eight, "hole"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", eight,
       "4 bytes after its data section"},
      {R"({"__metadata__": {"a": 1}})", "", "metadata 'a' is not a string"},
  };
  for (const Case& c : cases) {
    WriteRaw(path, c.header, c.data);
    const auto file = SafetensorsFile::Open(path);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr(c.expected))) << c.header;
  }
  // Offsets beyond the data section: the file is shorter than the header needs.
  WriteRaw(path, R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", eight);
  const auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr("truncated")));
  // A header length beyond the file.
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t length = 1000;
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(length >> (8 * i)));
    out << "{}";
  }
  EXPECT_EQ(SafetensorsFile::Open(path).status().code(), absl::StatusCode::kDataLoss);
  std::filesystem::remove(path);
}

// ---- the loader's errors: each names the file and what was expected ----

class LoaderErrors : public TinyModel {
 protected:
  absl::Status LoadWith(const std::string& model_path, const std::string& indexer_path) {
    return LlamaModel::Load(model_path, indexer_path).status();
  }
};

TEST_F(LoaderErrors, MissingAndTruncatedFiles) {
  const std::string missing = TempPath("missing.safetensors");
  absl::Status status = LoadWith(missing, *indexer_path_);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(missing));
  status = LoadWith(*model_path_, missing);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(missing));
  const std::string truncated = TempPath("truncated_model.safetensors");
  std::filesystem::copy_file(*model_path_, truncated,
                             std::filesystem::copy_options::overwrite_existing);
  const uint64_t size = std::filesystem::file_size(truncated);
  Truncate(truncated, size - 1000);
  status = LoadWith(truncated, "");
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(),
              AllOf(HasSubstr(truncated), HasSubstr(absl::StrCat("expected ", size)),
                    HasSubstr(absl::StrCat(size - 1000))));
  std::filesystem::remove(truncated);
}

TEST_F(LoaderErrors, WrongTensorsAndMetadata) {
  const std::string path = TempPath("broken_model.safetensors");
  const auto expect = [&](const absl::Status& written, const std::string& expected) {
    ASSERT_TRUE(written.ok()) << written;
    const absl::Status status = LoadWith(path, "");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(path), HasSubstr(expected)));
  };
  const std::map<std::string, std::string> meta = ConfigMetadata(*config_);
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "blk.1.ffn_up.weight"),
         "missing tensor 'blk.1.ffn_up.weight' (expected F32 [48, 32])");
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "", {{"blk.2.attn_k.weight", {16, 31}}}),
         "tensor 'blk.2.attn_k.weight' has shape [16, 31], expected F32 [16, 32]");
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "", {}, {{"output_norm.weight", "F16"}}),
         "tensor 'output_norm.weight' has dtype F16, expected F32 [32]");
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "", {}, {}, /*extra=*/true),
         "unexpected tensor 'rope_freqs.weight'");
  auto other = meta;
  other["dsa.format"] = "dsa-llama/2";
  expect(WriteTensors(path, other, *model_tensors_, "F32"),
         "'dsa.format' is 'dsa-llama/2', expected 'dsa-llama/1'");
  other = meta;
  other.erase("dsa.format");
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "no 'dsa.format'");
  other = meta;
  other.erase("ffn_dim");
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "metadata has no 'ffn_dim'");
  other = meta;
  other["num_heads"] = "four";
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "'num_heads' = 'four'");
  other = meta;
  other["num_kv_heads"] = "3";
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "multiple of num_kv_heads");
  // Called SmolLM2-135M, but with the tiny shapes.
  other = meta;
  other["dsa.model"] = kSmolLM2ModelName;
  expect(WriteTensors(path, other, *model_tensors_, "F32"),
         "'num_layers' is 3, expected 30 for smollm2-135m");
  std::filesystem::remove(path);
}

TEST_F(LoaderErrors, IndexerForAnotherModel) {
  const std::string path = TempPath("broken_indexer.safetensors");
  const auto expect = [&](const absl::Status& written, const std::string& expected) {
    ASSERT_TRUE(written.ok()) << written;
    const absl::Status status = LoadWith(*model_path_, path);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(path), HasSubstr(expected)));
  };
  auto meta = IndexerMetadata(*indexer_config_);
  // Two layers for a three-layer model.
  LightningIndexerConfig two = *indexer_config_;
  two.num_layers = 2;
  LlamaConfig two_layer_model = *config_;
  two_layer_model.num_layers = 2;
  expect(
      WriteTensors(path, IndexerMetadata(two), TinyIndexerTensors(two_layer_model, two, 1), "F16"),
      "the indexer has 2 layers, expected 3");
  // Made for a backbone of width 64.
  LlamaConfig wide = *config_;
  wide.d_model = 64;
  expect(WriteTensors(path, meta, TinyIndexerTensors(wide, *indexer_config_, 1), "F16"),
         "tensor 'blk.0.indexer.q_a.weight' has shape [8, 64], expected F16 or F32 [8, 32]");
  auto other = meta;
  other["base_model_sha256"] = "def";
  expect(WriteTensors(path, other, *indexer_tensors_, "F16"),
         "base_model_sha256 is def, expected abc");
  other = meta;
  other["dsa.format"] = kLlamaModelFormat;
  expect(WriteTensors(path, other, *indexer_tensors_, "F16"),
         "'dsa.format' is 'dsa-llama/1', expected 'dsa-indexer/1'");
  other = meta;
  other["rope_dims"] = "7";
  expect(WriteTensors(path, other, *indexer_tensors_, "F16"), "rope_dims (7)");
  expect(WriteTensors(path, meta, *indexer_tensors_, "F16", "blk.2.indexer.k_norm.bias"),
         "missing tensor 'blk.2.indexer.k_norm.bias'");
  std::filesystem::remove(path);
  // No indexer: loads; IndexerInputs is refused.
  auto model = LlamaModel::Load(*model_path_, "");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_FALSE((*model)->has_indexer());
  LlamaKvCache cache(**model);
  auto pass = LlamaForward::Begin(*model, {{&cache, 0, 1}});
  ASSERT_TRUE(pass.ok());
  std::vector<float> q(64), w(4), k(16);
  EXPECT_EQ((*pass)->IndexerInputs(q, w, k).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace dsa
