// Point-to-point channels of the torch backend.
//
// libddp runs a group's operations in issue order, so on one group `isend(to peer)` then
// `irecv(from peer)` on both ranks would wait for each other forever, while PyTorch lets
// them progress independently (batch_isend_irecv, pipeline schedules). So every direction
// of every pair that exchanges messages gets its own two-rank libddp group, created on
// first use: the sender is its rank 0, the receiver its rank 1, and only a->b messages
// travel on it, in the order they were issued (PyTorch's non-overtaking rule; tags are not
// matched). Each channel has a thread that creates the group (a rendezvous the other side
// joins whenever it first sends or receives in that direction) and runs the channel's
// operations one by one, so issuing never blocks.
//
// A receive from any source (PyTorch's src=None) learns who sent first from the store:
// every send adds one to a counter of its (sender, receiver) pair when it is issued (before
// the channel exists, which the receiver creates only then), and the
// receiver takes the lowest rank whose counter is ahead of the messages it has taken from
// that rank, then receives on that rank's channel. It costs every send one store update.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "ddp/pg.h"
#include "work.hpp"

namespace libddp_torch {

struct ChannelSetup {
  std::string backend, token;
  int64_t timeout_ms;
  ddp_store_t *store; // the group's bridge store; the channel takes a prefix view of it
};

// The store key that counts the messages `from` has sent to `to` (any-source receives).
std::string sent_key(int from, int to);

class P2PChannel {
 public:
  P2PChannel(const ChannelSetup &setup, int me, int peer, bool is_send);
  ~P2PChannel();
  // Queues the transfer of t (contiguous, kept alive by w) and returns at once.
  void post(at::Tensor t, c10::intrusive_ptr<WorkLibddp> w);

 private:
  struct Op {
    at::Tensor t;
    c10::intrusive_ptr<WorkLibddp> w;
  };
  void main();

  ChannelSetup setup_;
  int me_, peer_;
  bool is_send_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> ops_;
  bool stop_ = false;
  ddp_store_t *view_ = nullptr; // while the rendezvous runs (guarded by mu_)
  ddp_pg_t *pg_ = nullptr;      // once created (guarded by mu_; the thread's own copy is used)
  std::thread thread_;
};

} // namespace libddp_torch
