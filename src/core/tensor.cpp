#include "core/tensor.h"

namespace tessera {

TensorView::TensorView(void* ptr, DType t, std::initializer_list<int64_t> dims) : data(ptr), dtype(t) {
  check(dims.size() <= static_cast<size_t>(kMaxRank), "tensor rank " + std::to_string(dims.size()) + " exceeds " +
                                                          std::to_string(kMaxRank));
  rank = static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    check(d >= 0, "tensor extent must be non-negative, got " + std::to_string(d));
    shape[static_cast<size_t>(i++)] = d;
  }
  int64_t s = 1;
  for (int k = rank - 1; k >= 0; --k) {
    stride[static_cast<size_t>(k)] = s;
    s *= shape[static_cast<size_t>(k)];
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[static_cast<size_t>(i)];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int k = rank - 1; k >= 0; --k) {
    if (shape[static_cast<size_t>(k)] != 1 && stride[static_cast<size_t>(k)] != s) return false;
    s *= shape[static_cast<size_t>(k)];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[static_cast<size_t>(i)]);
  }
  return s + "]";
}

void TensorView::expect_shape(const std::string& what, std::initializer_list<int64_t> dims) const {
  bool ok = static_cast<int>(dims.size()) == rank;
  int i = 0;
  for (int64_t d : dims) {
    if (!ok) break;
    ok = d < 0 || shape[static_cast<size_t>(i)] == d;
    ++i;
  }
  if (ok) return;
  std::string want = "[";
  i = 0;
  for (int64_t d : dims) {
    if (i++) want += ", ";
    want += d < 0 ? std::string("*") : std::to_string(d);
  }
  throw Error(what + ": expected shape " + want + "], got " + shape_string());
}

void TensorView::expect_dtype(const std::string& what, std::initializer_list<DType> allowed) const {
  std::string names;
  for (DType t : allowed) {
    if (t == dtype) return;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(t));
  }
  throw Error(what + ": expected dtype " + names + ", got " + std::string(dtype_name(dtype)));
}

Tensor::Tensor(DType t, std::initializer_list<int64_t> dims) {
  view_ = TensorView(nullptr, t, dims);
  buffer_ = Buffer(static_cast<size_t>(view_.numel()) * dtype_size(t));
  view_.data = buffer_.data();
}

}  // namespace tessera
