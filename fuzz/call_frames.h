// Inputs of the RPC-handler harnesses: a sequence of calls, each a frame
//   [1 byte: method (low 7 bits) and caller (high bit)][2 bytes: length, little-endian][message]
// and a custom mutator that keeps them structured: it mutates one frame's message field by field
// with the method's request type (proto_mutator.h), changes a frame's method or caller, or
// duplicates, drops, swaps or adds frames. A message's bytes go to the handler as they are, so
// unparseable ones are tried too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fuzz/proto_mutator.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/status.h"

namespace dsa::fuzz {

struct Frame {
  uint8_t method = 0;  // index into the harness's request prototypes
  bool second_caller = false;
  std::string message;
};

/// A harness's check: traps (libFuzzer reports the input) when `ok` is false.
inline void Check(bool ok) {
  if (!ok) __builtin_trap();
}

/// The RPC harnesses' promise: a refusal has a precise code, never UNKNOWN, INTERNAL or DATA_LOSS.
inline void CheckCode(grpc::StatusCode code) {
  Check(code != grpc::StatusCode::UNKNOWN && code != grpc::StatusCode::INTERNAL &&
        code != grpc::StatusCode::DATA_LOSS);
}

inline constexpr size_t kFrameHeaderBytes = 3;
inline constexpr size_t kMaxFrames = 64;

/// The frames of `data` (a truncated last frame is dropped); methods are taken modulo `methods`.
inline std::vector<Frame> ParseFrames(const uint8_t* data, size_t size, size_t methods) {
  std::vector<Frame> frames;
  size_t at = 0;
  while (at + kFrameHeaderBytes <= size && frames.size() < kMaxFrames) {
    const size_t length = data[at + 1] | (static_cast<size_t>(data[at + 2]) << 8);
    if (at + kFrameHeaderBytes + length > size) break;
    Frame frame;
    frame.method = static_cast<uint8_t>((data[at] & 0x7f) % methods);
    frame.second_caller = (data[at] & 0x80) != 0;
    frame.message.assign(reinterpret_cast<const char*>(data + at + kFrameHeaderBytes), length);
    frames.push_back(std::move(frame));
    at += kFrameHeaderBytes + length;
  }
  return frames;
}

inline std::string SerializeFrames(const std::vector<Frame>& frames) {
  std::string out;
  for (const Frame& frame : frames) {
    const size_t length = std::min<size_t>(frame.message.size(), 0xffff);
    out.push_back(static_cast<char>(frame.method | (frame.second_caller ? 0x80 : 0)));
    out.push_back(static_cast<char>(length & 0xff));
    out.push_back(static_cast<char>(length >> 8));
    out.append(frame.message, 0, length);
  }
  return out;
}

/// Serialized `message` as one frame.
inline Frame MakeFrame(uint8_t method, const google::protobuf::Message& message,
                       bool second_caller = false) {
  return Frame{method, second_caller, message.SerializeAsString()};
}

/// LLVMFuzzerCustomMutator for frames whose method m carries a `prototypes[m]` message.
inline size_t MutateFrames(uint8_t* data, size_t size, size_t max_size, unsigned int seed,
                           const std::vector<const google::protobuf::Message*>& prototypes) {
  std::mt19937_64 rng(seed);
  std::vector<Frame> frames = ParseFrames(data, size, prototypes.size());
  const auto pick = [&rng](size_t n) { return static_cast<size_t>(rng() % n); };
  const size_t op = frames.empty() ? 5 : pick(8);
  if (op <= 2) {  // the message of one frame, field by field (3 in 8)
    Frame& frame = frames[pick(frames.size())];
    std::unique_ptr<google::protobuf::Message> scratch(prototypes[frame.method]->New());
    std::string buffer = frame.message;
    const size_t capacity = std::max<size_t>(buffer.size() * 2 + 64, 256);
    buffer.resize(capacity);
    const size_t mutated =
        MutateSerialized(*scratch, reinterpret_cast<uint8_t*>(buffer.data()), frame.message.size(),
                         capacity, static_cast<unsigned int>(rng()));
    buffer.resize(mutated);
    frame.message = std::move(buffer);
  } else if (op == 3) {  // another method, or the other caller
    Frame& frame = frames[pick(frames.size())];
    if (rng() % 2 == 0) {
      frame.method = static_cast<uint8_t>(pick(prototypes.size()));
    } else {
      frame.second_caller = !frame.second_caller;
    }
  } else if (op == 4 && frames.size() < kMaxFrames) {  // a frame again, elsewhere
    const Frame copy = frames[pick(frames.size())];
    frames.insert(frames.begin() + static_cast<std::ptrdiff_t>(pick(frames.size() + 1)), copy);
  } else if (op == 5 && frames.size() < kMaxFrames) {  // a new, empty call
    Frame frame;
    frame.method = static_cast<uint8_t>(pick(prototypes.size()));
    frames.insert(frames.begin() + static_cast<std::ptrdiff_t>(pick(frames.size() + 1)), frame);
  } else if (op == 6 && frames.size() > 1) {
    frames.erase(frames.begin() + static_cast<std::ptrdiff_t>(pick(frames.size())));
  } else if (frames.size() > 1) {
    std::swap(frames[pick(frames.size())], frames[pick(frames.size())]);
  }
  const std::string out = SerializeFrames(frames);
  if (out.size() > max_size) return size;  // unchanged: libFuzzer tries another mutation
  std::memcpy(data, out.data(), out.size());
  return out.size();
}

}  // namespace dsa::fuzz
