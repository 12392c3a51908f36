// Structured mutation for libFuzzer (docs/reliability.md, "libFuzzer"): the input is a serialized
// protobuf message; most mutations parse it, change one field through reflection (a boundary or
// random number, a flipped bool, an enum value in or out of range, a string or bytes field mutated
// by libFuzzer, a repeated element added, removed or changed, a sub-message cleared or recursed
// into) and serialize it again, so that the harness sees valid messages a field away from its
// seeds. The rest are libFuzzer's own byte mutations, so malformed wire data is tried too.
// (No protobuf mutator library is packaged for Debian 12; this is the part of one we need.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace dsa::fuzz {

namespace internal {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

inline std::string MutateBytes(std::string value) {
  const size_t size = value.size();
  const size_t max_size = size * 2 + 16;
  value.resize(max_size);
  value.resize(LLVMFuzzerMutate(reinterpret_cast<uint8_t*>(value.data()), size, max_size));
  return value;
}

template <typename T>
T Boundary(std::mt19937_64& rng) {
  const T choices[] = {0,
                       1,
                       static_cast<T>(-1),
                       std::numeric_limits<T>::max(),
                       std::numeric_limits<T>::min(),
                       static_cast<T>(64),
                       static_cast<T>(2048),
                       static_cast<T>(2049)};
  if (rng() % 4 == 0) return static_cast<T>(rng());
  return choices[rng() % (sizeof(choices) / sizeof(choices[0]))];
}

inline double FloatingBoundary(std::mt19937_64& rng) {
  const double choices[] = {0.0,
                            -0.0,
                            1.0,
                            -1.0,
                            0.5,
                            0.999999,
                            std::numeric_limits<double>::infinity(),
                            -std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::quiet_NaN(),
                            std::numeric_limits<double>::max(),
                            std::numeric_limits<double>::denorm_min()};
  if (rng() % 4 == 0) return std::uniform_real_distribution<double>(-10, 10)(rng);
  return choices[rng() % (sizeof(choices) / sizeof(choices[0]))];
}

// Sets a singular field, or element `index` of a repeated one (-1: add an element), to a new
// value of its type.
inline void SetValue(Message& message, const FieldDescriptor* field, int index,
                     std::mt19937_64& rng, int depth);

inline void MutateMessage(Message& message, std::mt19937_64& rng, int depth) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  if (descriptor->field_count() == 0) return;
  const FieldDescriptor* field =
      descriptor->field(static_cast<int>(rng() % descriptor->field_count()));
  const Reflection* reflection = message.GetReflection();
  if (field->is_repeated()) {
    const int size = reflection->FieldSize(message, field);
    switch (size == 0 ? 0 : rng() % 4) {
      case 0:
        SetValue(message, field, -1, rng, depth);  // add one
        break;
      case 1:
        reflection->RemoveLast(&message, field);
        break;
      default:
        SetValue(message, field, static_cast<int>(rng() % size), rng, depth);
        break;
    }
    return;
  }
  if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && rng() % 4 == 0) {
    reflection->ClearField(&message, field);
    return;
  }
  SetValue(message, field, 0, rng, depth);
}

inline void SetValue(Message& message, const FieldDescriptor* field, int index,
                     std::mt19937_64& rng, int depth) {
  const Reflection* r = message.GetReflection();
  const bool repeated = field->is_repeated();
  const bool add = repeated && index < 0;
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      const auto v = Boundary<int32_t>(rng);
      add        ? r->AddInt32(&message, field, v)
      : repeated ? r->SetRepeatedInt32(&message, field, index, v)
                 : r->SetInt32(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      const auto v = Boundary<int64_t>(rng);
      add        ? r->AddInt64(&message, field, v)
      : repeated ? r->SetRepeatedInt64(&message, field, index, v)
                 : r->SetInt64(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      const auto v = Boundary<uint32_t>(rng);
      add        ? r->AddUInt32(&message, field, v)
      : repeated ? r->SetRepeatedUInt32(&message, field, index, v)
                 : r->SetUInt32(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      const auto v = Boundary<uint64_t>(rng) % (rng() % 2 == 0 ? 16 : ~uint64_t{0});
      add        ? r->AddUInt64(&message, field, v)
      : repeated ? r->SetRepeatedUInt64(&message, field, index, v)
                 : r->SetUInt64(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v = FloatingBoundary(rng);
      add        ? r->AddDouble(&message, field, v)
      : repeated ? r->SetRepeatedDouble(&message, field, index, v)
                 : r->SetDouble(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const auto v = static_cast<float>(FloatingBoundary(rng));
      add        ? r->AddFloat(&message, field, v)
      : repeated ? r->SetRepeatedFloat(&message, field, index, v)
                 : r->SetFloat(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      const bool v = rng() % 2 == 0;
      add        ? r->AddBool(&message, field, v)
      : repeated ? r->SetRepeatedBool(&message, field, index, v)
                 : r->SetBool(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      // A declared value, or any number (proto3 keeps unknown enum values).
      const google::protobuf::EnumDescriptor* e = field->enum_type();
      const int v = rng() % 4 == 0 ? static_cast<int>(rng() % 64) - 8
                                   : e->value(static_cast<int>(rng() % e->value_count()))->number();
      add        ? r->AddEnumValue(&message, field, v)
      : repeated ? r->SetRepeatedEnumValue(&message, field, index, v)
                 : r->SetEnumValue(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string old = add        ? std::string()
                        : repeated ? r->GetRepeatedString(message, field, index)
                                   : r->GetString(message, field);
      std::string v = MutateBytes(std::move(old));
      if (field->type() == FieldDescriptor::TYPE_STRING && rng() % 2 == 0) {
        // Keep strings valid UTF-8 most of the time (invalid ones fail the parse up front).
        for (char& c : v) c = static_cast<char>(0x20 + (static_cast<unsigned char>(c) % 0x5f));
      }
      add        ? r->AddString(&message, field, v)
      : repeated ? r->SetRepeatedString(&message, field, index, v)
                 : r->SetString(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE: {
      if (depth > 4) break;
      Message* sub = add        ? r->AddMessage(&message, field)
                     : repeated ? r->MutableRepeatedMessage(&message, field, index)
                                : r->MutableMessage(&message, field);
      MutateMessage(*sub, rng, depth + 1);
      break;
    }
  }
}

}  // namespace internal

/// LLVMFuzzerCustomMutator's body for inputs that are serialized `Message`s: `prototype` is a
/// scratch message of the input's type.
inline size_t MutateSerialized(google::protobuf::Message& prototype, uint8_t* data, size_t size,
                               size_t max_size, unsigned int seed) {
  std::mt19937_64 rng(seed);
  if (rng() % 5 != 0 && prototype.ParseFromArray(data, static_cast<int>(size))) {
    const int mutations = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < mutations; ++i) internal::MutateMessage(prototype, rng, 0);
    std::string out;
    if (prototype.SerializeToString(&out) && out.size() <= max_size) {
      std::memcpy(data, out.data(), out.size());
      return out.size();
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

}  // namespace dsa::fuzz
