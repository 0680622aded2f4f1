// A libddp collective as a c10d Work: one or more libddp work handles issued in order, the
// tensors they read and write (kept alive until they end), and a finishing step (copies out
// of a staging buffer, a local fold) that runs exactly once, on whichever thread first sees
// the handles complete: the caller's wait(), is_completed(), or the group's completer thread
// for works whose future was asked for (DDP's reducer chains on getFuture()).
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "ddp/pg.h"

namespace libddp_torch {

class ProcessGroupLibddp;

// The text of a failed call, raised as a RuntimeError: "libddp allreduce of float[4] (SUM) on
// rank 0 failed (DDP_ERR_REMOTE): <libddp's message>". A timeout says "failed with a timeout
// (DDP_ERR_TIMEOUT)": scripts and PyTorch's own suite look for the word, as gloo's "Timed
// out" and NCCL's "timeout" carry it.
std::string failure_text(const std::string &what, int rank, ddp_status_t st,
                         const std::string &msg);

class WorkLibddp : public c10d::Work {
 public:
  // `what` names the collective for messages ("allreduce of float32[1000] (SUM)").
  WorkLibddp(ProcessGroupLibddp *pg, c10d::OpType type, std::string what,
             std::vector<at::Tensor> outputs, int64_t timeout_ms);
  ~WorkLibddp() override;

  // Building the work (issuing thread only, before the work is returned).
  void add_handle(ddp_work_t *w) { handles_.push_back(w); }
  void keep(at::Tensor t) { keep_.push_back(std::move(t)); }
  // Finishing steps, run in order once every handle has succeeded.
  void on_success(std::function<void()> fn) { finish_fns_.push_back(std::move(fn)); }
  void set_source_rank(int r) { source_rank_ = r; }
  // Point-to-point works run on a channel's thread (p2p.hpp) instead of libddp handles of
  // the group: the channel reports the end with external_done.
  void set_external() { external_ = true; }
  void external_done(ddp_status_t st, const std::string &msg);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Waits for every handle (bounded by the work's timeout) and finishes: the completer's
  // entry point. Never throws.
  void complete();

 private:
  // Runs the finishing step and completes the future; idempotent. st is the first failed
  // handle's status (DDP_OK when all succeeded), msg its message.
  void finish(ddp_status_t st, const std::string &msg);
  void settle(const c10::intrusive_ptr<c10::ivalue::Future> &fut); // completes or fails fut
  // Waits for the handles; timeout_ms < 0 means the collective's own deadline.
  ddp_status_t wait_handles(int64_t timeout_ms, std::string *msg);

  ProcessGroupLibddp *pg_; // must outlive the work (docs/torch.md, Limits)
  std::string what_;
  std::vector<ddp_work_t *> handles_;
  std::vector<at::Tensor> keep_;
  std::vector<at::Tensor> outputs_;
  std::vector<std::function<void()>> finish_fns_;
  int64_t timeout_ms_; // per-call timeout; < 0 = the group's
  int source_rank_ = -1;
  bool external_ = false;
  std::mutex ext_mu_;
  std::condition_variable ext_cv_;
  bool ext_done_ = false;
  ddp_status_t ext_st_ = DDP_OK;
  std::string ext_msg_;
  mutable std::mutex mu_;
  bool finished_ = false;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_; // made by getFuture, settled once
  bool future_requested_ = false;
};

} // namespace libddp_torch
