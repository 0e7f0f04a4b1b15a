// Mutates valid protobuf requests for the fuzz tests (peer_fuzz_test, control_fuzz_test): one random field per call
// set to an interesting or random value (integers at the edges, 10 KB strings, path-like strings, unknown enum
// values), repeated fields cleared, shortened, grown or changed, nested messages mutated or cleared.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"

namespace epfabric::testing {

class Mutator {
 public:
  using FieldDescriptor = google::protobuf::FieldDescriptor;
  using Message = google::protobuf::Message;
  using Reflection = google::protobuf::Reflection;

  explicit Mutator(uint64_t seed) : rng_(seed) {}

  void Mutate(Message* message, int depth = 0) {
    const auto* descriptor = message->GetDescriptor();
    if (descriptor->field_count() == 0) return;
    const FieldDescriptor* field = descriptor->field(Pick(descriptor->field_count()));
    const Reflection* reflection = message->GetReflection();
    if (field->is_repeated()) {
      const int size = reflection->FieldSize(*message, field);
      switch (Pick(4)) {
        case 0:
          reflection->ClearField(message, field);
          return;
        case 1:
          if (size > 0) reflection->RemoveLast(message, field);
          return;
        case 2:
          AddElement(message, field, depth);
          return;
        default:
          if (size > 0) MutateElement(message, field, Pick(size), depth);
          return;
      }
    }
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->SetInt32(message, field, static_cast<int32_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        reflection->SetUInt32(message, field, static_cast<uint32_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(message, field, Int());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetUInt64(message, field, static_cast<uint64_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        reflection->SetBool(message, field, !reflection->GetBool(*message, field));
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        reflection->SetEnumValue(message, field, static_cast<int>(Int() % 8));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(message, field, String());
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        if (depth < 4 && Pick(4) != 0) {
          Mutate(reflection->MutableMessage(message, field), depth + 1);
        } else {
          reflection->ClearField(message, field);
        }
        break;
      default:
        break;
    }
  }

  int Pick(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }

 private:
  int64_t Int() {
    static const int64_t kInteresting[] = {0,       -1,      1,         2,         3,         7,         100000,
                                           1 << 20, 1 << 30, INT32_MAX, INT32_MIN, 1ll << 48, INT64_MAX, INT64_MIN};
    if (Pick(3) == 0) return static_cast<int64_t>(rng_());
    return kInteresting[Pick(sizeof(kInteresting) / sizeof(kInteresting[0]))];
  }

  std::string String() {
    switch (Pick(8)) {
      case 0:
        return "";
      case 1:
        return "g";
      case 2:
        return std::string(10240, 'x');
      case 3:
        return "../../etc/passwd";
      case 4:
        return "/tmp/epf-fuzz.fds";
      case 5:
        return std::string(32, 'a');
      default: {
        std::string bytes(static_cast<size_t>(Pick(64)), '\0');
        for (char& c : bytes) c = static_cast<char>(rng_());
        return bytes;
      }
    }
  }

  void AddElement(Message* message, const FieldDescriptor* field, int depth) {
    const Reflection* reflection = message->GetReflection();
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->AddInt32(message, field, static_cast<int32_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        reflection->AddUInt32(message, field, static_cast<uint32_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->AddInt64(message, field, Int());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->AddUInt64(message, field, static_cast<uint64_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->AddString(message, field, String());
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE: {
        const int size = reflection->FieldSize(*message, field);
        Message* added = reflection->AddMessage(message, field);
        if (size > 0) added->CopyFrom(reflection->GetRepeatedMessage(*message, field, Pick(size)));
        if (depth < 4) Mutate(added, depth + 1);
        break;
      }
      default:
        break;
    }
  }

  void MutateElement(Message* message, const FieldDescriptor* field, int index, int depth) {
    const Reflection* reflection = message->GetReflection();
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->SetRepeatedInt32(message, field, index, static_cast<int32_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetRepeatedUInt64(message, field, index, static_cast<uint64_t>(Int()));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->SetRepeatedString(message, field, index, String());
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        if (depth < 4) Mutate(reflection->MutableRepeatedMessage(message, field, index), depth + 1);
        break;
      default:
        break;
    }
  }

  std::mt19937_64 rng_;
};

}  // namespace epfabric::testing
