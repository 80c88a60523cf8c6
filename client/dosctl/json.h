// dosctl's --json output: one schema for every command.
//
// A message prints as a JSON object with the .proto field names
// (snake_case), every field present (defaults included), nested messages as
// objects, repeated fields as arrays, enums as their names. Every integer,
// 64-bit ones included (session ids, counters, byte counts), is a JSON number
// written in full decimal, never a string: protobuf's own JSON mapping quotes
// 64-bit integers, which mixed "session_id": "7" with "pid": 7. Values stay
// below 2^53 in practice (ids count up from 1; bytes and counters of one
// node), so JavaScript and jq read them exactly too.
#ifndef DOS_CLIENT_DOSCTL_JSON_H_
#define DOS_CLIENT_DOSCTL_JSON_H_

#include <string>

#include "google/protobuf/message.h"

namespace dos::dosctl {

// Pretty-printed (two-space indent), ending in a newline.
std::string ToJson(const google::protobuf::Message& m);

}  // namespace dos::dosctl

#endif  // DOS_CLIENT_DOSCTL_JSON_H_
