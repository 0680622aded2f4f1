// ProcessGroupLibddp: c10d's ProcessGroup over a libddp group (docs/torch.md).
//
// Every collective maps onto libddp's (include/ddp/pg.h), so reductions add the ranks'
// values in rank order whatever the transport and the bucket layout, waits are bounded by
// the timeout, and a mismatched collective fails with both sides' fingerprints. What libddp
// has no primitive for is built from its collectives here: reduce (an allreduce), gather (an
// allgather), scatter (point-to-point sends from the root), uneven all-to-all (padded to the
// largest block), the bitwise ops and dtypes its kernels lack (an allgather, then a fold in
// rank order with ATen), monitored_barrier (the store). PyTorch 2.x derives c10d::Backend
// instead, with the same virtual functions (docs/torch.md, "PyTorch 2.x").
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ddp/pg.h"
#include "p2p.hpp"
#include "work.hpp"

namespace libddp_torch {

struct Config {
  std::string transport = "auto"; // auto | shm | tcp (gloo) | mpi
  std::string transport_source;   // where the choice came from, for messages
  std::string algorithm = "auto"; // auto | canonical | ring | small
  bool flight_recorder = true;    // false for groups whose dumps would take the job's names
  bool defer_start = true;        // ddp_pg_options_t.defer_start (libddp_torch.Options)
  bool group_buckets = true;      // DDP's buckets in the group's memory (Options.bucket_memory)
};

class ProcessGroupLibddp : public c10d::ProcessGroup {
 public:
  ProcessGroupLibddp(const c10::intrusive_ptr<c10d::Store> &store, int rank, int size,
                     std::chrono::milliseconds timeout, const Config &cfg);
  ~ProcessGroupLibddp() override;

  const std::string getBackendName() const override { return "libddp"; }
  const std::string &transport() const { return transport_; }
  // Whether DDP's reducer builds its buckets in this group's memory (module.cpp,
  // BucketAllocator): Options(bucket_memory="group"), and only on shm.
  bool group_buckets() const { return group_buckets_ && transport_ == "shm"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor> &tensors,
                                           const c10d::BroadcastOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> &tensors,
                                           const c10d::AllreduceOptions &opts) override;
  c10::intrusive_ptr<c10d::Work>
  allreduce_coalesced(std::vector<at::Tensor> &tensors,
                      const c10d::AllreduceCoalescedOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor> &tensors,
                                        const c10d::ReduceOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>> &outputs,
                                           std::vector<at::Tensor> &inputs,
                                           const c10d::AllgatherOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor &output, at::Tensor &input,
                                                 const c10d::AllgatherOptions &opts) override;
  c10::intrusive_ptr<c10d::Work>
  allgather_coalesced(std::vector<std::vector<at::Tensor>> &outputs,
                      std::vector<at::Tensor> &inputs,
                      const c10d::AllgatherOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>> &outputs,
                                        std::vector<at::Tensor> &inputs,
                                        const c10d::GatherOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor> &outputs,
                                         std::vector<std::vector<at::Tensor>> &inputs,
                                         const c10d::ScatterOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor> &outputs,
                                                std::vector<std::vector<at::Tensor>> &inputs,
                                                const c10d::ReduceScatterOptions &opts) override;
  c10::intrusive_ptr<c10d::Work>
  _reduce_scatter_base(at::Tensor &output, at::Tensor &input,
                       const c10d::ReduceScatterOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor &output, at::Tensor &input,
                                               std::vector<int64_t> &output_splits,
                                               std::vector<int64_t> &input_splits,
                                               const c10d::AllToAllOptions &opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor> &outputs,
                                          std::vector<at::Tensor> &inputs,
                                          const c10d::AllToAllOptions &opts) override;
  void monitoredBarrier(const c10d::BarrierOptions &opts, bool wait_all_ranks) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor> &tensors, int dst,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor> &tensors, int src,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor> &tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions &opts) override;

  // For WorkLibddp.
  ddp_pg_t *pg() const { return pg_; }
  // The C group's owner. Blocks of its memory in use (libddp_torch.empty, to_group_memory_)
  // share it, so the group they live in outlives this object until the last is freed. They
  // do not keep this object, and its threads, alive: the last such block is often freed by
  // Python's garbage collector at interpreter exit, when a thread of this object that wanted
  // the GIL would be ended by Python in the middle of C++ frames (std::terminate).
  const std::shared_ptr<ddp_pg_t> &pg_owner() const { return pg_owner_; }
  int64_t timeout_ms() const { return timeout_ms_; }
  void enqueue_completion(c10::intrusive_ptr<WorkLibddp> w);
  // True on any group's completer thread (where futures' callbacks run).
  static bool on_completer_thread();
  // Waits, up to timeout_ms, until no group's completer has a completion queued or running.
  // For Python's exit (libddp_torch registers it with atexit): a completer that runs a
  // future's Python callback takes the GIL once more after the callback has released the
  // waiter (to drop the callback), and if the main thread has meanwhile reached interpreter
  // finalization, Python ends that thread inside C++ frames: std::terminate, "terminate
  // called without an active exception", after a script's last step with a Python comm hook.
  static void quiesce(int64_t timeout_ms);
  // Throws c10::Error with "libddp <what> on rank R: <msg>", msg from the group if empty.
  [[noreturn]] void fail(const std::string &what, ddp_status_t st, const std::string &msg) const;

 private:
  c10::intrusive_ptr<WorkLibddp> make_work(c10d::OpType type, std::string what,
                                           std::vector<at::Tensor> outputs,
                                           std::chrono::milliseconds timeout);
  // Issues one libddp call; on failure throws naming `what`.
  void check_issue(ddp_status_t st, const std::string &what) const;
  // The reduction every reducing collective uses: in place on `t` (contiguous, CPU).
  void issue_allreduce(WorkLibddp &w, at::Tensor t, c10d::ReduceOp op, const std::string &what);
  void issue_allgather(WorkLibddp &w, const at::Tensor &in, const at::Tensor &out,
                       const std::string &what);
  // all_reduce of sparse COO tensors (sparse.cpp).
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor> &tensors,
                                                  const c10d::AllreduceOptions &opts,
                                                  const std::string &what);
  void completer_main();

  c10::intrusive_ptr<c10d::Work> p2p(std::vector<at::Tensor> &tensors, int peer, bool is_send);
  // The channel for messages to (is_send) or from peer, created on first use.
  P2PChannel &channel(int peer, bool is_send);

  ddp_pg_t *pg_ = nullptr;
  std::shared_ptr<ddp_pg_t> pg_owner_; // destroys pg_ (ddp_pg_destroy)
  c10::intrusive_ptr<c10d::Store> store_;
  ddp_store_t *ds_ = nullptr; // store_ as a libddp store, for the point-to-point channels
  std::string token_;
  std::mutex channels_mu_;
  std::map<std::pair<int, bool>, std::unique_ptr<P2PChannel>> channels_;
  std::map<int, int64_t> taken_; // messages received (or being received) from each rank
  std::string transport_;
  bool group_buckets_ = true;
  int64_t timeout_ms_;
  uint64_t seq_ = 0;
  uint64_t monitored_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<WorkLibddp>> pending_;
  bool stop_ = false;
  std::thread completer_;
};

} // namespace libddp_torch
