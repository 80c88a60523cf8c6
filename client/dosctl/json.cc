#include "client/dosctl/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"

namespace dos::dosctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

void Quote(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

void Double(double v, std::string* out) {
  if (!std::isfinite(v)) {  // JSON has no inf/nan: protobuf's mapping writes strings
    Quote(std::isnan(v) ? "NaN" : (v > 0 ? "Infinity" : "-Infinity"), out);
    return;
  }
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    absl::StrAppend(out, static_cast<int64_t>(v));
    return;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  // Shortest form that reads back the same.
  for (int p = 6; p < 17; ++p) {
    char shorter[32];
    std::snprintf(shorter, sizeof(shorter), "%.*g", p, v);
    if (std::strtod(shorter, nullptr) == v) {
      out->append(shorter);
      return;
    }
  }
  out->append(buf);
}

void Object(const Message& m, int indent, std::string* out);

void Value(const Message& m, const FieldDescriptor* f, int index, int indent,
           std::string* out) {
  const Reflection* r = m.GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      absl::StrAppend(out, rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      absl::StrAppend(out, rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      absl::StrAppend(out, rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      absl::StrAppend(out, rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      Double(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f), out);
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      Double(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f), out);
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      out->append((rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f)) ? "true" : "false");
      break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* e = rep ? r->GetRepeatedEnum(m, f, index) : r->GetEnum(m, f);
      Quote(e->name(), out);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      if (f->type() == FieldDescriptor::TYPE_BYTES) {
        Quote(absl::Base64Escape(s), out);
      } else {
        Quote(s, out);
      }
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      Object(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f), indent, out);
      break;
  }
}

void Newline(int indent, std::string* out) {
  out->push_back('\n');
  out->append(static_cast<size_t>(indent) * 2, ' ');
}

void Object(const Message& m, int indent, std::string* out) {
  const auto* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  if (d->field_count() == 0) {
    out->append("{}");
    return;
  }
  out->push_back('{');
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    // Unset members of a oneof are left out (protobuf's mapping does the same).
    if (f->containing_oneof() != nullptr && !r->HasField(m, f)) continue;
    if (out->back() != '{') out->push_back(',');
    Newline(indent + 1, out);
    Quote(f->name(), out);
    out->append(": ");
    if (!f->is_repeated()) {
      Value(m, f, 0, indent + 1, out);
      continue;
    }
    const int n = r->FieldSize(m, f);
    if (n == 0) {
      out->append("[]");
      continue;
    }
    out->push_back('[');
    for (int k = 0; k < n; ++k) {
      if (k > 0) out->push_back(',');
      Newline(indent + 2, out);
      Value(m, f, k, indent + 2, out);
    }
    Newline(indent + 1, out);
    out->push_back(']');
  }
  Newline(indent, out);
  out->push_back('}');
}

}  // namespace

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  Object(m, 0, &out);
  out.push_back('\n');
  return out;
}

}  // namespace dos::dosctl
