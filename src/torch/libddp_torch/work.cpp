// WorkLibddp: see work.hpp.
#include "work.hpp"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include "process_group.hpp"

namespace libddp_torch {
namespace {

// The future's value type, made once: List[Tensor].
const c10::TypePtr &tensor_list_type() {
  static const c10::TypePtr t = c10::ListType::create(c10::TensorType::get());
  return t;
}

// The name torch.profiler shows for a call, in gloo's pattern ("gloo:all_reduce"), or none
// while nothing records: c10d::Work then skips making its RecordFunction.
const char *profiling_title(c10d::OpType type) {
  if (!at::hasCallbacks()) return nullptr;
  switch (type) {
  case c10d::OpType::BROADCAST: return "libddp:broadcast";
  case c10d::OpType::ALLREDUCE: return "libddp:all_reduce";
  case c10d::OpType::ALLREDUCE_COALESCED: return "libddp:all_reduce_coalesced";
  case c10d::OpType::REDUCE: return "libddp:reduce";
  case c10d::OpType::ALLGATHER: return "libddp:all_gather";
  case c10d::OpType::_ALLGATHER_BASE: return "libddp:_all_gather_base";
  case c10d::OpType::ALLGATHER_COALESCED: return "libddp:all_gather_coalesced";
  case c10d::OpType::GATHER: return "libddp:gather";
  case c10d::OpType::SCATTER: return "libddp:scatter";
  case c10d::OpType::REDUCE_SCATTER: return "libddp:reduce_scatter";
  case c10d::OpType::_REDUCE_SCATTER_BASE: return "libddp:_reduce_scatter_base";
  case c10d::OpType::ALLTOALL_BASE: return "libddp:all_to_all_single";
  case c10d::OpType::ALLTOALL: return "libddp:all_to_all";
  case c10d::OpType::SEND: return "libddp:send";
  case c10d::OpType::RECV: return "libddp:recv";
  case c10d::OpType::RECVANYSOURCE: return "libddp:recvAnySource";
  case c10d::OpType::BARRIER: return "libddp:barrier";
  default: return "libddp:unknown";
  }
}

} // namespace

WorkLibddp::WorkLibddp(ProcessGroupLibddp *pg, c10d::OpType type, std::string what,
                       std::vector<at::Tensor> outputs, int64_t timeout_ms)
    : c10d::Work(pg->getRank(), type, profiling_title(type),
                 at::hasCallbacks() ? c10::optional<std::vector<at::Tensor>>(outputs)
                                    : c10::nullopt),
      pg_(pg), what_(std::move(what)), outputs_(std::move(outputs)), timeout_ms_(timeout_ms) {}

WorkLibddp::~WorkLibddp() {
  // The handles may still read or write the buffers this work keeps alive: wait for them
  // (bounded by the collective's deadline) before the buffers go.
  complete();
  for (ddp_work_t *h : handles_) ddp_work_free(h);
}

std::string failure_text(const std::string &what, int rank, ddp_status_t st,
                         const std::string &msg) {
  return "libddp " + what + " on rank " + std::to_string(rank) + " failed" +
         (st == DDP_ERR_TIMEOUT ? " with a timeout (" : " (") + ddp_status_name(st) + "): " + msg;
}

void WorkLibddp::external_done(ddp_status_t st, const std::string &msg) {
  {
    std::lock_guard<std::mutex> g(ext_mu_);
    ext_done_ = true;
    ext_st_ = st;
    ext_msg_ = msg;
  }
  ext_cv_.notify_all();
}

ddp_status_t WorkLibddp::wait_handles(int64_t timeout_ms, std::string *msg) {
  if (external_) {
    // The channel's own libddp wait is bounded by the group's timeout; one more second here.
    int64_t ms = timeout_ms < 0 ? pg_->timeout_ms() + 1000 : timeout_ms;
    std::unique_lock<std::mutex> g(ext_mu_);
    if (!ext_cv_.wait_for(g, std::chrono::milliseconds(ms), [this] { return ext_done_; })) {
      *msg = "timed out";
      return DDP_ERR_TIMEOUT;
    }
    *msg = ext_msg_;
    return ext_st_;
  }
  for (ddp_work_t *h : handles_) {
    ddp_status_t st = ddp_work_wait(h, timeout_ms);
    if (st != DDP_OK) {
      const char *m = ddp_work_error(h);
      *msg = m && m[0] ? m : ddp_status_str(st);
      return st;
    }
  }
  return DDP_OK;
}

void WorkLibddp::finish(ddp_status_t st, const std::string &msg) {
  std::unique_lock<std::mutex> g(mu_);
  if (finished_) return;
  finished_ = true;
  if (st == DDP_OK) {
    try {
      at::NoGradGuard no_grad; // outputs are written as data (process_group.cpp, make_work)
      for (auto &fn : finish_fns_) fn();
    } catch (const std::exception &e) {
      st = DDP_ERR_INVALID_USAGE;
      error_ = std::make_exception_ptr(
          std::runtime_error("libddp " + what_ + ": finishing failed: " + e.what()));
    }
  }
  if (st != DDP_OK && !error_) {
    error_ = std::make_exception_ptr(
        std::runtime_error(failure_text(what_, pg_->getRank(), st, msg)));
  }
  finish_fns_.clear();
  keep_.clear();
  // The profiler's event (c10d::Work's constructor began it) ends with the call.
  if (recordFunctionEndCallback_) {
    recordFunctionEndCallback_();
    recordFunctionEndCallback_ = nullptr;
  }
  // The future exists only once asked for (getFuture): a synchronous call never makes one.
  // Its callbacks run inside markCompleted (DDP's, a comm hook's next collective): never
  // under this work's lock.
  c10::intrusive_ptr<c10::ivalue::Future> fut = future_;
  g.unlock();
  if (fut) settle(fut);
}

void WorkLibddp::settle(const c10::intrusive_ptr<c10::ivalue::Future> &fut) {
  std::exception_ptr error = exception();
  if (error) {
    fut->setError(error);
  } else {
    fut->markCompleted(c10::IValue(outputs_));
  }
}

void WorkLibddp::complete() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (finished_) return;
  }
  std::string msg;
  ddp_status_t st = wait_handles(timeout_ms_ < 0 ? -1 : timeout_ms_, &msg);
  if (st == DDP_ERR_TIMEOUT && timeout_ms_ >= 0) {
    // A per-call timeout shorter than the group's: the collective is abandoned, and like a
    // timed-out gloo context the group cannot be used again; peers are told why.
    msg = what_ + " timed out after " + std::to_string(timeout_ms_) +
          " ms (the call's timeout) on rank " + std::to_string(pg_->getRank());
    ddp_pg_abort_reason(pg_->pg(), msg.c_str());
  }
  finish(st, msg);
}

bool WorkLibddp::isCompleted() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (finished_) return true;
  }
  if (external_) {
    std::lock_guard<std::mutex> g(ext_mu_);
    if (!ext_done_) return false;
  }
  for (ddp_work_t *h : handles_) {
    bool done = false;
    ddp_work_test(h, &done);
    if (!done) return false;
  }
  complete(); // every handle has ended: finishing does not block
  return true;
}

bool WorkLibddp::isSuccess() const {
  std::lock_guard<std::mutex> g(mu_);
  return finished_ && !error_;
}

std::exception_ptr WorkLibddp::exception() const {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

int WorkLibddp::sourceRank() const {
  TORCH_CHECK(source_rank_ >= 0, "libddp: sourceRank() is only defined for a recv");
  return source_rank_;
}

std::vector<at::Tensor> WorkLibddp::result() { return outputs_; }

bool WorkLibddp::wait(std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout) {
    complete();
  } else {
    std::string msg;
    ddp_status_t st = wait_handles(timeout.count(), &msg);
    if (st == DDP_ERR_TIMEOUT) {
      msg = what_ + " timed out after " + std::to_string(timeout.count()) +
            " ms (wait's timeout) on rank " + std::to_string(pg_->getRank());
      ddp_pg_abort_reason(pg_->pg(), msg.c_str());
    }
    finish(st, msg);
  }
  std::lock_guard<std::mutex> g(mu_);
  if (error_) std::rethrow_exception(error_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkLibddp::getFuture() {
  // Made here, under the lock that finish() reads it under: a future made before the work
  // finished is settled by finish(), one made after it by this call.
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  bool made = false, finished = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type());
      made = true;
    }
    fut = future_;
    finished = finished_;
  }
  if (made && finished) settle(fut);
  if (ProcessGroupLibddp::on_completer_thread()) {
    // Asked from a future's callback that the completer runs (PowerSGD issues its next
    // allreduce there and waits on it): the completer cannot finish it later, so finish it
    // now. The group runs collectives in issue order, so this waits for this one only.
    complete();
    return fut;
  }
  bool enqueue = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!finished_ && !future_requested_) enqueue = true;
    future_requested_ = true;
  }
  if (enqueue) pg_->enqueue_completion(c10::intrusive_ptr<WorkLibddp>::reclaim_copy(this));
  return fut;
}

} // namespace libddp_torch
