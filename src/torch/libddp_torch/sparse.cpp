// all_reduce of sparse COO tensors: the gradients of nn.Embedding(sparse=True) and
// nn.EmbeddingBag(sparse=True), which DistributedDataParallel reduces one tensor a bucket.
//
// gloo's algorithm, step for step, so that the result is gloo's bit for bit. Each rank
// coalesces its tensor (its list's tensors summed first), and the ranks first share a fixed
// record of it (nnz, sparse and dense dimensions, sizes): it says how much the second
// exchange moves and lets every rank check that the tensors agree, naming the rank that
// differs. Then every rank's indices and values are gathered, padded to the largest nnz, and
// summed in rank order with ATen's sparse addition, ((t0 + t1) + t2) ..., which merges two
// sorted index lists and adds the values of an index both hold as t + s; the sum is
// coalesced and copied into the caller's tensors. The record's exchange runs on the calling
// thread (the second exchange's sizes depend on it); the gathers and the sum run as any
// other work of the group. SUM only, as gloo.
#include "process_group.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace libddp_torch {

namespace {

// The record each rank shares: its nnz, then what every rank must agree on.
enum { REC_NNZ, REC_SPARSE_DIM, REC_DENSE_DIM, REC_DIM, REC_SIZES };
constexpr int64_t kMaxDims = 64;
constexpr int64_t kRecordLen = REC_SIZES + kMaxDims;

std::string shape_of(const int64_t *rec) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < rec[REC_DIM]; d++) s << (d ? ", " : "") << rec[REC_SIZES + d];
  s << "] (sparse_dim " << rec[REC_SPARSE_DIM] << ", dense_dim " << rec[REC_DENSE_DIM] << ")";
  return s.str();
}

} // namespace

c10::intrusive_ptr<c10d::Work>
ProcessGroupLibddp::allreduce_sparse(std::vector<at::Tensor> &tensors,
                                     const c10d::AllreduceOptions &opts, const std::string &what) {
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "libddp ", what,
              ": sparse tensors are reduced with SUM only (as gloo)");
  // ATen's sparse addition lacks some dtypes on the CPU (Half): refused before any exchange,
  // by a sum of two one-element tensors of the dtype.
  try {
    auto one = at::sparse_coo_tensor(at::zeros({1, 1}, at::kLong),
                                     at::ones({1}, tensors[0].options().layout(at::kStrided)),
                                     {1}, tensors[0].options());
    (void)(one + one);
  } catch (const c10::Error &e) {
    TORCH_CHECK(false, "libddp ", what, ": sparse ", tensors[0].scalar_type(),
                " tensors cannot be summed on the CPU (", e.what_without_backtrace(), ")");
  }
  at::Tensor input = tensors[0];
  for (size_t i = 1; i < tensors.size(); i++) input = input + tensors[i];
  input = input.coalesce();
  TORCH_CHECK(input.dim() <= kMaxDims, "libddp ", what, ": more than ", kMaxDims, " dimensions");

  const int world = getSize();
  at::Tensor rec = at::zeros({kRecordLen}, at::kLong);
  int64_t *r = rec.data_ptr<int64_t>();
  r[REC_NNZ] = input._nnz();
  r[REC_SPARSE_DIM] = input.sparse_dim();
  r[REC_DENSE_DIM] = input.dense_dim();
  r[REC_DIM] = input.dim();
  for (int64_t d = 0; d < input.dim(); d++) r[REC_SIZES + d] = input.size(d);
  at::Tensor recs = at::empty({world, kRecordLen}, at::kLong);
  ddp_work_t *h = nullptr;
  check_issue(ddp_allgather(pg_, rec.data_ptr(), recs.data_ptr(), kRecordLen, DDP_I64, &h), what);
  ddp_status_t st = ddp_work_wait(h, -1);
  std::string msg = st == DDP_OK ? "" : (ddp_work_error(h) ? ddp_work_error(h) : "");
  ddp_work_free(h);
  if (st != DDP_OK) fail(what, st, msg);

  const int64_t *all = recs.data_ptr<int64_t>();
  std::vector<int64_t> nnz(world);
  int64_t max_nnz = 0;
  for (int q = 0; q < world; q++) {
    const int64_t *o = all + q * kRecordLen;
    TORCH_CHECK(std::equal(o + REC_SPARSE_DIM, o + kRecordLen, r + REC_SPARSE_DIM), "libddp ",
                what, ": the ranks' sparse tensors differ: rank ", q, "'s is ", shape_of(o),
                ", rank ", getRank(), "'s ", shape_of(r));
    nnz[q] = o[REC_NNZ];
    max_nnz = std::max(max_nnz, nnz[q]);
  }

  // This rank's indices and values, padded to the largest nnz, then every rank's.
  const int64_t sparse_dim = input.sparse_dim();
  at::Tensor values = input._values();
  std::vector<int64_t> vshape = values.sizes().vec();
  vshape[0] = max_nnz;
  at::Tensor idx = at::zeros({sparse_dim, max_nnz}, at::kLong);
  at::Tensor val = at::zeros(vshape, values.options());
  idx.narrow(1, 0, r[REC_NNZ]).copy_(input._indices());
  val.narrow(0, 0, r[REC_NNZ]).copy_(values);
  vshape.insert(vshape.begin(), world);
  at::Tensor all_idx = at::empty({world, sparse_dim, max_nnz}, at::kLong);
  at::Tensor all_val = at::empty(vshape, values.options());

  auto w = make_work(c10d::OpType::ALLREDUCE, what, tensors, opts.timeout);
  issue_allgather(*w, idx, all_idx, what);
  issue_allgather(*w, val, all_val, what);
  std::vector<at::Tensor> ts = tensors;
  std::vector<int64_t> sizes = input.sizes().vec();
  at::TensorOptions options = input.options();
  w->on_success([ts, all_idx, all_val, nnz, sizes, options]() {
    at::Tensor sum;
    for (size_t q = 0; q < nnz.size(); q++) {
      at::Tensor part = at::sparse_coo_tensor(all_idx[q].narrow(1, 0, nnz[q]).contiguous(),
                                              all_val[q].narrow(0, 0, nnz[q]), sizes, options);
      if (q == 0) sum = part;
      else sum += part;
    }
    sum = sum.coalesce();
    for (const at::Tensor &t : ts) t.copy_(sum);
  });
  return w;
}

} // namespace libddp_torch
