#include "epctl/json_contract.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include <google/protobuf/reflection.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace epfabric::epctl {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string Pad(int indent) { return std::string(2 * static_cast<size_t>(indent), ' '); }

bool Omitted(const FieldDescriptor* field, const OmittedFields& omitted) {
  return omitted.count(std::string(field->full_name())) != 0;
}

std::string Number(double value) {
  if (std::isnan(value)) return "\"NaN\"";
  if (std::isinf(value)) return value > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  return absl::StrFormat("%.17g", value);
}

// One value of a singular field, or element `index` of a repeated one (index -1: singular).
std::string Scalar(const Message& message, const FieldDescriptor* field, int index, const OmittedFields& omitted,
                   int indent) {
  const Reflection* r = message.GetReflection();
  const bool rep = index >= 0;
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(rep ? r->GetRepeatedInt32(message, field, index) : r->GetInt32(message, field));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(rep ? r->GetRepeatedUInt32(message, field, index) : r->GetUInt32(message, field));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat("\"", rep ? r->GetRepeatedInt64(message, field, index) : r->GetInt64(message, field), "\"");
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat("\"", rep ? r->GetRepeatedUInt64(message, field, index) : r->GetUInt64(message, field), "\"");
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return Number(rep ? r->GetRepeatedDouble(message, field, index) : r->GetDouble(message, field));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return Number(rep ? r->GetRepeatedFloat(message, field, index) : r->GetFloat(message, field));
    case FieldDescriptor::CPPTYPE_BOOL:
      return (rep ? r->GetRepeatedBool(message, field, index) : r->GetBool(message, field)) ? "true" : "false";
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* value = rep ? r->GetRepeatedEnum(message, field, index) : r->GetEnum(message, field);
      return JsonString(std::string(value->name()));
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string text = rep ? r->GetRepeatedString(message, field, index) : r->GetString(message, field);
      return JsonString(field->type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(text) : text);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ContractJson(rep ? r->GetRepeatedMessage(message, field, index) : r->GetMessage(message, field), omitted,
                          indent);
  }
  return "null";
}

// A map field as an object with its keys sorted (map order is unspecified in protobuf).
std::string MapObject(const Message& message, const FieldDescriptor* field, const OmittedFields& omitted, int indent) {
  const Reflection* r = message.GetReflection();
  const FieldDescriptor* key = field->message_type()->map_key();
  const FieldDescriptor* value = field->message_type()->map_value();
  std::vector<std::pair<std::string, std::string>> entries;
  for (int i = 0; i < r->FieldSize(message, field); ++i) {
    const Message& entry = r->GetRepeatedMessage(message, field, i);
    std::string key_text = Scalar(entry, key, -1, omitted, indent + 1);
    if (key_text.empty() || key_text[0] != '"') key_text = absl::StrCat("\"", key_text, "\"");
    entries.emplace_back(std::move(key_text), Scalar(entry, value, -1, omitted, indent + 1));
  }
  std::sort(entries.begin(), entries.end());
  if (entries.empty()) return "{}";
  std::string s = "{\n";
  for (size_t i = 0; i < entries.size(); ++i) {
    absl::StrAppend(&s, Pad(indent + 1), entries[i].first, ": ", entries[i].second, i + 1 < entries.size() ? "," : "",
                    "\n");
  }
  absl::StrAppend(&s, Pad(indent), "}");
  return s;
}

std::string ScalarSchema(const FieldDescriptor* field) {
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_UINT32:
      return R"({"type": "integer"})";
    case FieldDescriptor::CPPTYPE_INT64:
    case FieldDescriptor::CPPTYPE_UINT64:
      return field->cpp_type() == FieldDescriptor::CPPTYPE_INT64 ? R"({"type": "string", "pattern": "^-?[0-9]+$"})"
                                                                 : R"({"type": "string", "pattern": "^[0-9]+$"})";
    case FieldDescriptor::CPPTYPE_DOUBLE:
    case FieldDescriptor::CPPTYPE_FLOAT:
      return R"({"type": ["number", "string"]})";
    case FieldDescriptor::CPPTYPE_BOOL:
      return R"({"type": "boolean"})";
    case FieldDescriptor::CPPTYPE_ENUM: {
      std::vector<std::string> names;
      for (int i = 0; i < field->enum_type()->value_count(); ++i) {
        names.push_back(JsonString(std::string(field->enum_type()->value(i)->name())));
      }
      return absl::StrCat(R"({"enum": [)", absl::StrJoin(names, ", "), "]}");
    }
    case FieldDescriptor::CPPTYPE_STRING:
      return R"({"type": "string"})";
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return absl::StrCat(R"({"$ref": "#/$defs/)", field->message_type()->full_name(), "\"}");
  }
  return "{}";
}

void CollectDefs(const Descriptor* type, const OmittedFields& omitted, std::map<std::string, std::string>* defs) {
  const std::string name(type->full_name());
  if (defs->count(name) != 0) return;
  (*defs)[name] = "";  // a placeholder: recursion stops here
  std::vector<std::string> properties, required;
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor* field = type->field(i);
    if (Omitted(field, omitted)) continue;
    std::string schema;
    if (field->is_map()) {
      const FieldDescriptor* value = field->message_type()->map_value();
      if (value->message_type() != nullptr) CollectDefs(value->message_type(), omitted, defs);
      schema = absl::StrCat(R"({"type": "object", "additionalProperties": )", ScalarSchema(value), "}");
    } else {
      if (field->message_type() != nullptr) CollectDefs(field->message_type(), omitted, defs);
      schema = field->is_repeated() ? absl::StrCat(R"({"type": "array", "items": )", ScalarSchema(field), "}")
                                    : ScalarSchema(field);
    }
    properties.push_back(absl::StrCat("        ", JsonString(std::string(field->name())), ": ", schema));
    required.push_back(JsonString(std::string(field->name())));
  }
  (*defs)[name] = absl::StrCat(
      "{\n      \"type\": \"object\",\n      \"properties\": {",
      properties.empty() ? "}" : absl::StrCat("\n", absl::StrJoin(properties, ",\n"), "\n      }"),
      ",\n      \"required\": [", absl::StrJoin(required, ", "), "],\n      \"additionalProperties\": false\n    }");
}

}  // namespace

std::string JsonString(const std::string& text) {
  std::string s = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        s += "\\\"";
        break;
      case '\\':
        s += "\\\\";
        break;
      case '\n':
        s += "\\n";
        break;
      case '\r':
        s += "\\r";
        break;
      case '\t':
        s += "\\t";
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(&s, "\\u%04x", c);
        } else {
          s += static_cast<char>(c);
        }
    }
  }
  return s + "\"";
}

std::string ContractJson(const Message& message, const OmittedFields& omitted, int indent) {
  const Descriptor* type = message.GetDescriptor();
  const Reflection* r = message.GetReflection();
  std::vector<std::string> members;
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor* field = type->field(i);
    if (Omitted(field, omitted)) continue;
    std::string value;
    if (field->is_map()) {
      value = MapObject(message, field, omitted, indent + 1);
    } else if (field->is_repeated()) {
      const int size = r->FieldSize(message, field);
      if (size == 0) {
        value = "[]";
      } else {
        value = "[\n";
        for (int j = 0; j < size; ++j) {
          absl::StrAppend(&value, Pad(indent + 2), Scalar(message, field, j, omitted, indent + 2),
                          j + 1 < size ? "," : "", "\n");
        }
        absl::StrAppend(&value, Pad(indent + 1), "]");
      }
    } else {
      value = Scalar(message, field, -1, omitted, indent + 1);
    }
    members.push_back(absl::StrCat(Pad(indent + 1), JsonString(std::string(field->name())), ": ", value));
  }
  if (members.empty()) return "{}";
  return absl::StrCat("{\n", absl::StrJoin(members, ",\n"), "\n", Pad(indent), "}");
}

std::string ContractSchema(const Descriptor* type, const std::string& title, const OmittedFields& omitted) {
  std::map<std::string, std::string> defs;
  CollectDefs(type, omitted, &defs);
  std::vector<std::string> entries;
  for (const auto& [name, schema] : defs) entries.push_back(absl::StrCat("    ", JsonString(name), ": ", schema));
  return absl::StrCat("{\n  \"$schema\": \"https://json-schema.org/draft/2020-12/schema\",\n  \"title\": ",
                      JsonString(title), ",\n  \"$ref\": \"#/$defs/", type->full_name(), "\",\n  \"$defs\": {\n",
                      absl::StrJoin(entries, ",\n"), "\n  }\n}\n");
}

}  // namespace epfabric::epctl
