// tessera/model/tokenizer/unicode_nfc_tables.h — generated Unicode tables for NFC (see gen_unicode_nfc.py).
#pragma once

#include <cstdint>

namespace tessera::model::unicode::tables {

struct Decomposition {
  char32_t cp;
  uint8_t length;
  char32_t to[4];  // full canonical decomposition, zero-padded
};
struct CombiningClass {
  char32_t cp;
  uint8_t ccc;
};
struct Composition {
  char32_t first, second, composite;
};

// All three sorted by code point (compositions by (first, second)).
extern const int kDecompositionWidth;
extern const int kDecompositionCount;
extern const Decomposition kDecompositions[];
extern const int kCombiningClassCount;
extern const CombiningClass kCombiningClasses[];
extern const int kCompositionCount;
extern const Composition kCompositions[];

}  // namespace tessera::model::unicode::tables
