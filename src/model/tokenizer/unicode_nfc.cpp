#include "model/tokenizer/unicode_nfc.h"

#include <algorithm>
#include <vector>

#include "model/tokenizer/unicode_nfc_tables.h"
#include "model/tokenizer/utf8.h"

namespace tessera::model::unicode {

namespace {

namespace t = tables;

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;
constexpr char32_t kRawByte = 0x80000000u;  // marks an invalid input byte carried through unchanged

int ccc(char32_t cp) {
  const auto* end = t::kCombiningClasses + t::kCombiningClassCount;
  const auto* it = std::lower_bound(t::kCombiningClasses, end, cp,
                                    [](const t::CombiningClass& e, char32_t v) { return e.cp < v; });
  return it != end && it->cp == cp ? it->ccc : 0;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* end = t::kDecompositions + t::kDecompositionCount;
  const auto* it = std::lower_bound(t::kDecompositions, end, cp,
                                    [](const t::Decomposition& e, char32_t v) { return e.cp < v; });
  if (it != end && it->cp == cp) {
    out.insert(out.end(), it->to, it->to + it->length);
  } else {
    out.push_back(cp);
  }
}

// The primary composite of (a, b), or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto* end = t::kCompositions + t::kCompositionCount;
  const auto* it =
      std::lower_bound(t::kCompositions, end, std::pair{a, b}, [](const t::Composition& e, auto v) {
        return e.first != v.first ? e.first < v.first : e.second < v.second;
      });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

}  // namespace

std::string nfc(std::string_view text) {
  // Fast path: ASCII is always NFC.
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    return std::string(text);
  }
  std::vector<char32_t> cps;
  cps.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = utf8::char_length(text, pos);
    if (n == 1 && static_cast<unsigned char>(text[pos]) >= 0x80) {
      cps.push_back(kRawByte | static_cast<unsigned char>(text[pos]));
    } else {
      decompose(utf8::decode_at(text, pos), cps);
    }
    pos += n;
  }
  auto class_of = [](char32_t cp) { return (cp & kRawByte) ? 0 : ccc(cp); };
  // Canonical ordering: stable-sort each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (class_of(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && class_of(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j,
                     [&](char32_t a, char32_t b) { return class_of(a) < class_of(b); });
    i = j;
  }
  // Canonical composition.
  std::vector<char32_t> out;
  out.reserve(cps.size());
  size_t starter = SIZE_MAX;  // index in `out` of the last starter
  int last_class = -1;        // class of the last character appended after the starter
  for (char32_t cp : cps) {
    const int cls = class_of(cp);
    if (starter != SIZE_MAX && !(out[starter] & kRawByte) && !(cp & kRawByte)) {
      const bool blocked = last_class != -1 && (last_class == 0 || last_class >= cls);
      if (!blocked) {
        const char32_t c = compose(out[starter], cp);
        if (c != 0) {
          out[starter] = c;
          continue;
        }
      }
    }
    if (cls == 0) {
      starter = out.size();
      last_class = -1;
    } else {
      last_class = cls;
    }
    out.push_back(cp);
  }
  std::string s;
  s.reserve(text.size());
  for (char32_t cp : out) {
    if (cp & kRawByte) {
      s += static_cast<char>(cp & 0xFF);
    } else {
      utf8::append(s, cp);
    }
  }
  return s;
}

}  // namespace tessera::model::unicode
