// Tests of the NCCL data plane's wire format (no GPU): requests, selections, refusals and the
// close message survive a round trip bit for bit; truncated, corrupt and oversized messages are
// refused with the documented codes (and never read out of bounds); the indexer side's answer
// function packs what its handler returns, within the size the request announced.
#include "transport/nccl_wire.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

constexpr int kH = 4, kD = 8;

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

LayerSelectRequest Empty() {
  LayerSelectRequest request;
  request.num_heads = kH;
  request.head_dim = kD;
  return request;
}

LayerSelectRequest MakeRequest(std::mt19937& rng) {
  LayerSelectRequest request;
  request.num_heads = kH;
  request.head_dim = kD;
  // A decode row with one new key, three verifier rows with none, one row with 5 new keys.
  const int rows[] = {1, 3, 1};
  const int keys[] = {1, 0, 5};
  for (int g = 0; g < 3; ++g) {
    SelectRowGroup group;
    group.sequence_id = 1000 + g;
    group.layer = g;
    group.first_position = 4096 + 7 * g;
    group.num_rows = rows[g];
    group.queries = Random(rows[g] * kH * kD, rng);
    group.head_weights = Random(rows[g] * kH, rng);
    group.new_index_keys = Random(keys[g] * kD, rng);
    request.groups.push_back(group);
  }
  return request;
}

LayerSelection MakeSelection(const LayerSelectRequest& request, int top_k, bool audit) {
  LayerSelection selection;
  for (const SelectRowGroup& group : request.groups) {
    GroupSelection answer;
    answer.num_rows = group.num_rows;
    answer.top_k = top_k;
    for (int i = 0; i < group.num_rows * top_k; ++i) {
      answer.selections.push_back(i % 5 == 4 ? -1 : i * 3 + static_cast<int>(group.layer));
    }
    answer.blocks_scored = 10 + group.layer;
    answer.blocks_visible = 65;
    answer.all_blocks = group.layer == 1;
    if (audit) answer.audit_miss_rates.assign(group.num_rows, 0.125);
    selection.groups.push_back(answer);
  }
  return selection;
}

// The request message of `request` (header + payload) and its sizes.
std::vector<uint8_t> Pack(const LayerSelectRequest& request, uint64_t id, const WireLimits& limits,
                          WireRequestSizes* sizes) {
  auto sized = SizeWireRequest(request, limits);
  EXPECT_TRUE(sized.ok()) << sized.status();
  *sizes = *sized;
  std::vector<uint8_t> message(kWireHeaderBytes + sizes->payload_bytes, 0xAB);
  PackWireRequest(request, id, *sizes, message);
  return message;
}

std::span<const uint8_t> Payload(const std::vector<uint8_t>& message) {
  return std::span<const uint8_t>(message).subspan(kWireHeaderBytes);
}

void ExpectSameRequest(const LayerSelectRequest& a, const LayerSelectRequest& b) {
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  ASSERT_EQ(a.groups.size(), b.groups.size());
  for (size_t g = 0; g < a.groups.size(); ++g) {
    EXPECT_EQ(a.groups[g].sequence_id, b.groups[g].sequence_id);
    EXPECT_EQ(a.groups[g].layer, b.groups[g].layer);
    EXPECT_EQ(a.groups[g].first_position, b.groups[g].first_position);
    EXPECT_EQ(a.groups[g].num_rows, b.groups[g].num_rows);
    EXPECT_EQ(a.groups[g].queries, b.groups[g].queries);
    EXPECT_EQ(a.groups[g].head_weights, b.groups[g].head_weights);
    EXPECT_EQ(a.groups[g].new_index_keys, b.groups[g].new_index_keys);
  }
}

void ExpectSameSelection(const LayerSelection& a, const LayerSelection& b) {
  ASSERT_EQ(a.groups.size(), b.groups.size());
  for (size_t g = 0; g < a.groups.size(); ++g) {
    EXPECT_EQ(a.groups[g].num_rows, b.groups[g].num_rows);
    EXPECT_EQ(a.groups[g].top_k, b.groups[g].top_k);
    EXPECT_EQ(a.groups[g].selections, b.groups[g].selections);
    EXPECT_EQ(a.groups[g].blocks_scored, b.groups[g].blocks_scored);
    EXPECT_EQ(a.groups[g].blocks_visible, b.groups[g].blocks_visible);
    EXPECT_EQ(a.groups[g].all_blocks, b.groups[g].all_blocks);
    EXPECT_EQ(a.groups[g].audit_miss_rates, b.groups[g].audit_miss_rates);
  }
}

TEST(NcclWireTest, ARequestSurvivesARoundTrip) {
  std::mt19937 rng(1);
  const WireLimits limits;
  const LayerSelectRequest request = MakeRequest(rng);
  WireRequestSizes sizes;
  const std::vector<uint8_t> message = Pack(request, 42, limits, &sizes);
  auto header = DecodeWireHeader(message, limits);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->kind, WireKind::kRequest);
  EXPECT_EQ(header->request_id, 42u);
  EXPECT_EQ(header->payload_bytes, sizes.payload_bytes);
  EXPECT_EQ(header->response_bytes, sizes.response_bytes);
  const int rows[] = {1, 3, 1};
  EXPECT_EQ(sizes.response_bytes, WireResponseBytes(rows, limits));
  auto decoded = UnpackWireRequest(*header, Payload(message), limits);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameRequest(request, *decoded);
}

TEST(NcclWireTest, SelectionsErrorsAndCloseSurviveARoundTrip) {
  std::mt19937 rng(2);
  const WireLimits limits{.max_top_k = 64};
  const LayerSelectRequest request = MakeRequest(rng);
  for (const bool audit : {false, true}) {
    const LayerSelection selection = MakeSelection(request, 64, audit);
    auto payload_bytes = SizeWireSelection(selection, limits);
    ASSERT_TRUE(payload_bytes.ok()) << payload_bytes.status();
    std::vector<uint8_t> answer(kWireHeaderBytes + *payload_bytes + 100, 0xCD);  // with padding
    PackWireSelection(selection, 7, *payload_bytes, answer);
    auto header = DecodeWireHeader(answer, limits);
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(header->kind, WireKind::kSelection);
    EXPECT_EQ(header->request_id, 7u);
    auto decoded = UnpackWireSelection(*header, Payload(answer), limits);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ExpectSameSelection(selection, *decoded);
  }

  std::vector<uint8_t> error(kWireHeaderBytes + kMaxWireErrorMessageBytes);
  PackWireError(absl::NotFoundError("group 1: sequence 99 not found"), 1, 8, error);
  auto header = DecodeWireHeader(error, limits);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->kind, WireKind::kError);
  const absl::Status refused = UnpackWireError(*header, Payload(error));
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(refused.message(), "group 1: sequence 99 not found");
  EXPECT_EQ(refused.GetPayload(kGroupsAppliedPayload).value_or(absl::Cord("none")), "1");

  // A message longer than the answer's room is cut, not overrun.
  std::vector<uint8_t> small(kWireHeaderBytes + 10);
  PackWireError(absl::InvalidArgumentError(std::string(100, 'x')), 0, 9, small);
  header = DecodeWireHeader(small, limits);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(UnpackWireError(*header, Payload(small)).message(), std::string(10, 'x'));

  std::vector<uint8_t> close(kWireHeaderBytes);
  PackWireClose(close);
  header = DecodeWireHeader(close, limits);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->kind, WireKind::kClose);
  EXPECT_EQ(header->payload_bytes, 0);
}

TEST(NcclWireTest, TruncatedOrCorruptHeadersAreRefused) {
  std::mt19937 rng(3);
  const WireLimits limits;
  WireRequestSizes sizes;
  const std::vector<uint8_t> message = Pack(MakeRequest(rng), 5, limits, &sizes);
  for (size_t length : {size_t{0}, size_t{1}, size_t{63}}) {
    auto header = DecodeWireHeader(std::span<const uint8_t>(message).first(length), limits);
    EXPECT_EQ(header.status().code(), absl::StatusCode::kInternal) << length;
  }
  // Any one flipped bit of the header is caught (magic, version or checksum).
  for (int bit = 0; bit < kWireHeaderBytes * 8; ++bit) {
    std::vector<uint8_t> corrupt = message;
    corrupt[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_EQ(DecodeWireHeader(corrupt, limits).status().code(), absl::StatusCode::kInternal)
        << "bit " << bit;
  }
}

TEST(NcclWireTest, HeaderFieldsOutOfRangeAreRefusedWithTheLimitNamed) {
  const WireLimits limits{.max_message_bytes = 1 << 20, .max_groups = 8};
  auto decode = [&](const WireHeader& header) {
    std::vector<uint8_t> bytes(kWireHeaderBytes);
    EncodeWireHeader(header, bytes);
    return DecodeWireHeader(bytes, limits).status();
  };
  const WireHeader good{.kind = WireKind::kRequest,
                        .payload_bytes = 1024,
                        .response_bytes = 8192,
                        .num_groups = 2,
                        .num_heads = kH,
                        .head_dim = kD};
  EXPECT_TRUE(decode(good).ok()) << decode(good);
  WireHeader h = good;
  h.payload_bytes = 1 << 20;
  EXPECT_EQ(decode(h).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(decode(h).message().find("max_message_bytes"), std::string::npos) << decode(h);
  h = good;
  h.num_groups = 9;
  EXPECT_EQ(decode(h).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(decode(h).message().find("max_groups"), std::string::npos) << decode(h);
  h = good;
  h.response_bytes = 2 << 20;
  EXPECT_EQ(decode(h).code(), absl::StatusCode::kResourceExhausted);
  for (auto mutate : std::vector<void (*)(WireHeader&)>{
           [](WireHeader& x) { x.num_groups = 0; }, [](WireHeader& x) { x.num_heads = 0; },
           [](WireHeader& x) { x.head_dim = 2000; }, [](WireHeader& x) { x.payload_bytes = -1; },
           [](WireHeader& x) { x.payload_bytes = 10; },  // cannot hold 2 records
           [](WireHeader& x) { x.response_bytes = 100; },
           [](WireHeader& x) { x.kind = static_cast<WireKind>(9); }}) {
    h = good;
    mutate(h);
    EXPECT_EQ(decode(h).code(), absl::StatusCode::kInvalidArgument) << decode(h);
  }
  EXPECT_EQ(decode({.kind = WireKind::kError, .status_code = 0}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode({.kind = WireKind::kError, .status_code = 17}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode({.kind = WireKind::kError, .status_code = 5, .groups_applied = -1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode({.kind = WireKind::kClose, .payload_bytes = 4}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclWireTest, CorruptRequestPayloadsAreRefused) {
  std::mt19937 rng(4);
  const WireLimits limits{.max_rows_per_group = 16, .max_new_keys_per_group = 64};
  WireRequestSizes sizes;
  const std::vector<uint8_t> message = Pack(MakeRequest(rng), 5, limits, &sizes);
  const WireHeader header = *DecodeWireHeader(message, limits);
  // Truncated payload.
  EXPECT_EQ(UnpackWireRequest(header, Payload(message).first(sizes.payload_bytes - 1), limits)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A payload size that does not match the groups' layout.
  WireHeader longer = header;
  longer.payload_bytes += 16;
  std::vector<uint8_t> padded = message;
  padded.resize(padded.size() + 16);
  EXPECT_EQ(UnpackWireRequest(longer, Payload(padded), limits).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Group record fields: rows (offset 12), position (16), new keys (24) of group 1.
  auto with_field = [&](size_t at, int64_t value, size_t bytes) {
    std::vector<uint8_t> corrupt = message;
    std::memcpy(corrupt.data() + kWireHeaderBytes + 32 + at, &value, bytes);
    return UnpackWireRequest(header, Payload(corrupt), limits).status();
  };
  EXPECT_EQ(with_field(12, 0, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(with_field(12, -5, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(with_field(12, 2, 4).code(), absl::StatusCode::kInvalidArgument);  // layout mismatch
  EXPECT_EQ(with_field(12, 17, 4).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(with_field(12, 17, 4).message().find("max_rows_per_group"), std::string::npos);
  EXPECT_EQ(with_field(8, -1, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(with_field(16, -1, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(with_field(16, int64_t{1} << 40, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(with_field(24, -1, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(with_field(24, 65, 8).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(with_field(24, int64_t{1} << 62, 8).code(), absl::StatusCode::kResourceExhausted);
  // Random bytes in the records never crash and never pass unnoticed as a different shape.
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> corrupt = message;
    const size_t at = kWireHeaderBytes + rng() % (3 * 32);
    corrupt[at] = static_cast<uint8_t>(rng());
    auto decoded = UnpackWireRequest(header, Payload(corrupt), limits);
    if (decoded.ok()) {
      ASSERT_EQ(decoded->groups.size(), 3u);
      for (const SelectRowGroup& g : decoded->groups) {
        ASSERT_EQ(g.queries.size(), static_cast<size_t>(g.num_rows * kH * kD));
      }
    }
  }
}

TEST(NcclWireTest, CorruptSelectionPayloadsAreRefused) {
  std::mt19937 rng(5);
  const WireLimits limits{.max_top_k = 16};
  const LayerSelection selection = MakeSelection(MakeRequest(rng), 16, true);
  const int64_t payload_bytes = *SizeWireSelection(selection, limits);
  std::vector<uint8_t> answer(kWireHeaderBytes + payload_bytes);
  PackWireSelection(selection, 3, payload_bytes, answer);
  const WireHeader header = *DecodeWireHeader(answer, limits);
  auto with = [&](size_t at, const void* value, size_t bytes) {
    std::vector<uint8_t> corrupt = answer;
    std::memcpy(corrupt.data() + kWireHeaderBytes + at, value, bytes);
    return UnpackWireSelection(header, Payload(corrupt), limits).status();
  };
  const int32_t zero = 0, big_k = 17, small_k = 8;
  const int64_t negative = -1, many = 1000;
  const uint8_t two = 2;
  EXPECT_EQ(with(0, &zero, 4).code(), absl::StatusCode::kInvalidArgument);      // rows
  EXPECT_EQ(with(4, &big_k, 4).code(), absl::StatusCode::kResourceExhausted);   // K > max
  EXPECT_EQ(with(4, &small_k, 4).code(), absl::StatusCode::kInvalidArgument);   // layout
  EXPECT_EQ(with(8, &negative, 8).code(), absl::StatusCode::kInvalidArgument);  // scored
  EXPECT_EQ(with(8, &many, 8).code(), absl::StatusCode::kInvalidArgument);      // > visible
  EXPECT_EQ(with(24, &two, 1).code(), absl::StatusCode::kInvalidArgument);      // all_blocks
  EXPECT_EQ(with(25, &two, 1).code(), absl::StatusCode::kInvalidArgument);      // audited
  // A slot below the -1 padding, and a miss rate outside [0, 1].
  const int32_t bad_slot = -2;
  std::vector<uint8_t> corrupt = answer;
  const int64_t first_slot = (3 * 32 + 15) / 16 * 16;
  std::memcpy(corrupt.data() + kWireHeaderBytes + first_slot, &bad_slot, 4);
  EXPECT_EQ(UnpackWireSelection(header, Payload(corrupt), limits).status().code(),
            absl::StatusCode::kInvalidArgument);
  const double bad_rate = 1.5;
  corrupt = answer;
  const int64_t first_rate = (first_slot + 16 * 4 + 15) / 16 * 16;
  std::memcpy(corrupt.data() + kWireHeaderBytes + first_rate, &bad_rate, 8);
  EXPECT_EQ(UnpackWireSelection(header, Payload(corrupt), limits).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      UnpackWireSelection(header, Payload(answer).first(payload_bytes - 4), limits).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(NcclWireTest, RequestsTheWireCannotCarryAreRefusedBeforePacking) {
  std::mt19937 rng(6);
  LayerSelectRequest request = MakeRequest(rng);
  EXPECT_EQ(SizeWireRequest(Empty(), {}).status().code(), absl::StatusCode::kInvalidArgument);
  auto status = SizeWireRequest(request, {.max_groups = 2}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("max_groups"), std::string::npos) << status;
  status = SizeWireRequest(request, {.max_message_bytes = 8192}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("max_message_bytes"), std::string::npos) << status;
  // The answer, sized for max_top_k, must fit too.
  status = SizeWireRequest(request, {.max_message_bytes = 65536, .max_top_k = 4096}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("max_top_k"), std::string::npos) << status;
  LayerSelectRequest bad = request;
  bad.groups[1].queries.pop_back();
  EXPECT_EQ(SizeWireRequest(bad, {}).status().code(), absl::StatusCode::kInvalidArgument);
  bad = request;
  bad.groups[0].new_index_keys.push_back(1.0f);  // not a multiple of D
  EXPECT_EQ(SizeWireRequest(bad, {}).status().code(), absl::StatusCode::kInvalidArgument);
  bad = request;
  bad.num_heads = 0;
  EXPECT_EQ(SizeWireRequest(bad, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclWireTest, TheAnswerFunctionPacksTheHandlersSelectionOrRefusal) {
  std::mt19937 rng(7);
  const WireLimits limits{.max_top_k = 32};
  const LayerSelectRequest request = MakeRequest(rng);
  WireRequestSizes sizes;
  const std::vector<uint8_t> message = Pack(request, 11, limits, &sizes);
  const WireHeader header = *DecodeWireHeader(message, limits);
  auto answer_with = [&](const WireSelectHandler& handler) {
    std::vector<uint8_t> answer(sizes.response_bytes, 0xEE);
    AnswerWireRequest(handler, header, Payload(message), limits, answer);
    return answer;
  };
  // A selection: the handler saw the request as sent.
  std::vector<uint8_t> answer = answer_with([&](const LayerSelectRequest& seen, int*) {
    ExpectSameRequest(request, seen);
    return absl::StatusOr<LayerSelection>(MakeSelection(seen, 32, true));
  });
  auto decoded_header = DecodeWireHeader(answer, limits);
  ASSERT_TRUE(decoded_header.ok()) << decoded_header.status();
  EXPECT_EQ(decoded_header->kind, WireKind::kSelection);
  EXPECT_EQ(decoded_header->request_id, 11u);
  auto selection = UnpackWireSelection(*decoded_header, Payload(answer), limits);
  ASSERT_TRUE(selection.ok()) << selection.status();
  ExpectSameSelection(MakeSelection(request, 32, true), *selection);
  // A refusal, with its groups applied.
  answer = answer_with([](const LayerSelectRequest&, int* applied) {
    *applied = 2;
    return absl::StatusOr<LayerSelection>(absl::FailedPreconditionError("group 2: awaits Commit"));
  });
  decoded_header = DecodeWireHeader(answer, limits);
  ASSERT_TRUE(decoded_header.ok());
  absl::Status refused = UnpackWireError(*decoded_header, Payload(answer));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.GetPayload(kGroupsAppliedPayload).value_or(absl::Cord()), "2");
  // A K above max_top_k does not fit the answer: RESOURCE_EXHAUSTED, every group counted applied.
  answer = answer_with([](const LayerSelectRequest& seen, int*) {
    return absl::StatusOr<LayerSelection>(MakeSelection(seen, 64, false));
  });
  refused = UnpackWireError(*DecodeWireHeader(answer, limits), Payload(answer));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("max_top_k"), std::string::npos) << refused;
  EXPECT_EQ(refused.GetPayload(kGroupsAppliedPayload).value_or(absl::Cord()), "3");
  // A request that does not decode never reaches the handler.
  WireHeader longer = header;
  longer.payload_bytes += 16;
  std::vector<uint8_t> padded = message;
  padded.resize(padded.size() + 16);
  std::vector<uint8_t> out(sizes.response_bytes);
  bool called = false;
  AnswerWireRequest(
      [&](const LayerSelectRequest&, int*) {
        called = true;
        return absl::StatusOr<LayerSelection>(LayerSelection{});
      },
      longer, Payload(padded), limits, out);
  EXPECT_FALSE(called);
  refused = UnpackWireError(*DecodeWireHeader(out, limits), Payload(out));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.GetPayload(kGroupsAppliedPayload).value_or(absl::Cord()), "0");
}

// The owner check in front of the handler (what NcclSelectionServer runs for a data plane opened
// by a verified caller): a request naming another caller's sequence is refused whole, before the
// handler runs, and travels back as PERMISSION_DENIED with groups_applied 0.
TEST(NcclWireTest, TheOwnerCheckRefusesARequestWithAnotherCallersSequenceBeforeTheHandler) {
  std::mt19937 rng(11);
  const WireLimits limits{.max_top_k = 32};
  const LayerSelectRequest request = MakeRequest(rng);
  ASSERT_GE(request.groups.size(), 2u);
  const uint64_t theirs = request.groups.back().sequence_id;
  int handled = 0;
  WireSelectHandler handler = [&](const LayerSelectRequest& seen, int*) {
    ++handled;
    return absl::StatusOr<LayerSelection>(MakeSelection(seen, 32, false));
  };
  std::vector<uint64_t> checked;
  WireSelectHandler owned = WithOwnerCheck(handler, [&](uint64_t sequence_id) {
    checked.push_back(sequence_id);
    return sequence_id == theirs ? absl::PermissionDeniedError(absl::StrCat(
                                       "sequence ", sequence_id, " belongs to another caller"))
                                 : absl::OkStatus();
  });
  WireRequestSizes sizes;
  const std::vector<uint8_t> message = Pack(request, 5, limits, &sizes);
  std::vector<uint8_t> answer(sizes.response_bytes);
  AnswerWireRequest(owned, *DecodeWireHeader(message, limits), Payload(message), limits, answer);
  EXPECT_EQ(handled, 0);
  EXPECT_EQ(checked.size(), request.groups.size());  // every group up to the refused one
  const absl::Status refused = UnpackWireError(*DecodeWireHeader(answer, limits), Payload(answer));
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(refused.message().find(absl::StrCat("sequence ", theirs)), std::string::npos)
      << refused;
  EXPECT_EQ(refused.GetPayload(kGroupsAppliedPayload).value_or(absl::Cord()), "0");

  // Without that group the request reaches the handler.
  LayerSelectRequest mine = request;
  mine.groups.pop_back();
  int applied = -1;
  EXPECT_TRUE(owned(mine, &applied).ok());
  EXPECT_EQ(handled, 1);
  // No check: the handler itself.
  EXPECT_TRUE(WithOwnerCheck(handler, nullptr)(request, &applied).ok());
  EXPECT_EQ(handled, 2);
}

}  // namespace
}  // namespace dsa
