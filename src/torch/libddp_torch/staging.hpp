// Contiguous stand-ins for strided tensors (docs/torch.md, "Tensors").
//
// libddp reads and writes a collective's buffers as flat runs of elements. A tensor that is
// not contiguous (a transposed or sliced view, a channels_last activation) is handed to it
// as a contiguous copy instead, and what the collective wrote into that copy goes back into
// the caller's view as the work's last finishing step, when every value has arrived. The
// result is the one the same call on `t.contiguous()` gives, element by element, whatever
// layout each rank's tensor has. (gloo hands such a tensor's storage to its algorithms as if
// it were contiguous: right for a permutation of a whole tensor when every rank permutes
// alike, wrong for a slice.) Contiguous tensors, what DDP and nearly every script pass, go
// through untouched; the cost of a copy each way is paid only where a view needs it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <string>
#include <utility>
#include <vector>

#include "work.hpp"

namespace libddp_torch {

class Staging {
 public:
  // A contiguous tensor with t's values, for a tensor the collective only reads.
  static at::Tensor in(const at::Tensor &t) { return t.contiguous(); }

  // A contiguous tensor the collective writes, standing in for t until commit: t itself when
  // contiguous, else a copy (of t's values when `with_values`: a tensor reduced or broadcast
  // in place). An output whose elements share memory (an expanded tensor) cannot receive
  // distinct values, and is refused naming `what`.
  at::Tensor out(const at::Tensor &t, const std::string &what, bool with_values = true) {
    if (t.is_contiguous()) return t;
    TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "libddp ", what,
                ": an output tensor has elements that share memory (sizes ", t.sizes(),
                ", strides ", t.strides(), "); pass one with distinct elements, as "
                "torch.empty_like gives");
    at::Tensor c = with_values ? t.contiguous() : at::empty_like(t, at::MemoryFormat::Contiguous);
    back_.emplace_back(t, c);
    return c;
  }

  // Copies the stand-ins back into their views once the work has succeeded, after the work's
  // own finishing steps (which may write the stand-ins). Call after the last on_success.
  void commit(WorkLibddp &w) {
    if (back_.empty()) return;
    w.on_success([back = std::move(back_)]() mutable {
      for (auto &vc : back) vc.first.copy_(vc.second);
    });
    back_.clear();
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> back_; // (caller's view, stand-in)
};

} // namespace libddp_torch
