// The JSON that `epctl COMMAND --json` prints, and its JSON Schema, both derived from one description so that they
// cannot disagree (docs/epctl-json.md; the schema files live in docs/epctl-json/).
//
// A document is one proto message (the command's response) printed as an object:
//  - keys are the proto field names, in the order the .proto declares them; every field is printed, set or not
//    (numbers 0, strings "", arrays [], nested messages as objects with all their fields);
//  - values follow the proto3 JSON mapping: 64-bit integers as decimal strings, enums by name, bytes as base64,
//    floats and doubles as numbers ("NaN", "Infinity", "-Infinity" as strings), maps as objects with sorted keys;
//  - fields a command never fills (a lease id in `leases`) are left out, and the schema says so.
// Output is indented by two spaces and ends with a newline: the same input always prints the same bytes.
#pragma once

#include <set>
#include <string>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

namespace epfabric::epctl {

// Full field names ("epfabric.v1.ClientInfo.lease_id") a document leaves out.
using OmittedFields = std::set<std::string>;

// `message` as a contract document (no trailing newline), indented by `indent` levels of two spaces.
std::string ContractJson(const google::protobuf::Message& message, const OmittedFields& omitted = {}, int indent = 0);

// A JSON string literal (quotes and escapes) for `text`.
std::string JsonString(const std::string& text);

// The JSON Schema (draft 2020-12) of ContractJson documents of `type`: every message a "$defs" entry named by its
// full name, every object closed (additionalProperties false) with all its keys required.
std::string ContractSchema(const google::protobuf::Descriptor* type, const std::string& title,
                           const OmittedFields& omitted = {});

}  // namespace epfabric::epctl
