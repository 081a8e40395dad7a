// Well-formed UTF-8 (RFC 3629): what a proto3 string field must hold (protobuf refuses to parse
// anything else) and what JSON text must be. Shared by the job file reader and the REST gateway.
#ifndef OFFLOAD_BASE_UTF8_H_
#define OFFLOAD_BASE_UTF8_H_

#include <cstddef>

#include "absl/strings/string_view.h"

namespace offload {

// The length (1 to 4) of the well-formed sequence that starts at s[i], or 0 when none does: a
// stray continuation byte, a truncated sequence, an overlong form, a UTF-16 surrogate, or a code
// point above U+10FFFF.
inline size_t Utf8SequenceLength(absl::string_view s, size_t i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  // The length from the lead byte; some lead bytes narrow the second byte's range.
  size_t length = 0;
  unsigned char lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) {
    length = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    length = 3;
    if (c == 0xe0) lo = 0xa0;  // overlong
    if (c == 0xed) hi = 0x9f;  // surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    length = 4;
    if (c == 0xf0) lo = 0x90;  // overlong
    if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (length > s.size() - i) return 0;
  for (size_t k = 1; k < length; ++k) {
    const unsigned char b = static_cast<unsigned char>(s[i + k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xbf)) return 0;
  }
  return length;
}

// Where the first byte that is not part of well-formed UTF-8 is, or npos.
inline size_t InvalidUtf8At(absl::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t length = Utf8SequenceLength(s, i);
    if (length == 0) return i;
    i += length;
  }
  return absl::string_view::npos;
}

}  // namespace offload

#endif  // OFFLOAD_BASE_UTF8_H_
