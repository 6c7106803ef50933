// tessera/core/tensor.h — strided tensor views and owning host tensors.
//
// A TensorView is a non-owning (data, dtype, shape, strides) tuple; strides are in elements. Rank is at most
// kMaxRank. Views carry the contract checks used at API boundaries (expect_shape, expect_dtype) so that a
// wrong shape is an Error naming the argument, not a crash.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/buffer.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tessera {

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> stride{};  // in elements

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* ptr, DType t, std::initializer_list<int64_t> dims);

  int64_t dim(int i) const { return shape[static_cast<size_t>(i)]; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[4, 8, 64]"

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
  // Address of element (i0, i1, ...) — only the first `rank` indices are used.
  template <class T>
  T* at(int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const {
    return static_cast<T*>(data) + i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3];
  }

  // Throws Error("<what>: expected shape [..], got [..]") unless the shape matches; -1 matches any extent.
  void expect_shape(const std::string& what, std::initializer_list<int64_t> dims) const;
  void expect_dtype(const std::string& what, std::initializer_list<DType> allowed) const;
};

// Owning, contiguous, 64-byte-aligned host tensor.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType t, std::initializer_list<int64_t> dims);
  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: a tensor is usable wherever a view is
  template <class T>
  T* ptr() const { return view_.ptr<T>(); }
  int64_t numel() const { return view_.numel(); }
  int64_t dim(int i) const { return view_.dim(i); }

 private:
  Buffer buffer_;
  TensorView view_;
};

}  // namespace tessera
