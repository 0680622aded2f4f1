// P2PChannel: see p2p.hpp.
#include "p2p.hpp"

namespace libddp_torch {

std::string sent_key(int from, int to) {
  return "libddp/p2p/sent/" + std::to_string(from) + "-" + std::to_string(to);
}

P2PChannel::P2PChannel(const ChannelSetup &setup, int me, int peer, bool is_send)
    : setup_(setup), me_(me), peer_(peer), is_send_(is_send) {
  thread_ = std::thread([this] { main(); });
}

P2PChannel::~P2PChannel() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  {
    // Unblock the thread wherever it waits: in the rendezvous, or in a transfer.
    std::lock_guard<std::mutex> g(mu_);
    if (view_) ddp_store_cancel(view_);
    if (pg_) ddp_pg_abort_reason(pg_, "the process group was destroyed");
  }
  thread_.join();
  ddp_pg_destroy(pg_);
}

void P2PChannel::post(at::Tensor t, c10::intrusive_ptr<WorkLibddp> w) {
  {
    std::lock_guard<std::mutex> g(mu_);
    ops_.push_back(Op{std::move(t), std::move(w)});
  }
  cv_.notify_one();
}

void P2PChannel::main() {
  int from = is_send_ ? me_ : peer_, to = is_send_ ? peer_ : me_;
  std::string failure;
  ddp_status_t failed = DDP_OK;
  ddp_store_t *view = nullptr;
  ddp_error_t err = {};
  std::string prefix = "libddp/p2p/" + std::to_string(from) + "-" + std::to_string(to);
  ddp_status_t st = ddp_store_create_prefix(setup_.store, prefix.c_str(), &view, &err);
  if (st == DDP_OK) {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_) ddp_store_cancel(view);
    view_ = view;
  }
  ddp_pg_t *pg = nullptr;
  if (st == DDP_OK) {
    ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
    o.backend = setup_.backend.c_str();
    o.rank = is_send_ ? 0 : 1;
    o.world = 2;
    o.store = view;
    o.timeout_ms = setup_.timeout_ms;
    o.job_token = setup_.token.c_str();
    o.no_flight_recorder = true; // the job's dumps are the process group's (docs/torch.md)
    st = ddp_pg_create(&o, &pg, &err);
    std::lock_guard<std::mutex> g(mu_);
    view_ = nullptr;
    ddp_store_destroy(view);
    pg_ = pg;
  }
  if (st != DDP_OK) {
    failed = st;
    failure = "the channel for messages from rank " + std::to_string(from) + " to rank " +
              std::to_string(to) + " could not be set up: " + err.msg;
  }
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return stop_ || !ops_.empty(); });
      if (ops_.empty()) return;
      op = std::move(ops_.front());
      ops_.pop_front();
    }
    if (failed != DDP_OK) {
      op.w->external_done(failed, failure);
      continue;
    }
    ddp_dtype_t dt = DDP_U8;
    size_t count = static_cast<size_t>(op.t.numel()) * op.t.element_size();
    st = is_send_ ? ddp_send(pg, op.t.data_ptr(), count, dt, 1, nullptr)
                  : ddp_recv(pg, op.t.data_ptr(), count, dt, 0, nullptr);
    std::string msg;
    if (st != DDP_OK) {
      ddp_error_t e = {};
      ddp_pg_last_error_copy(pg, &e);
      msg = e.msg;
      // The pair group is failed: later operations on it fail the same way.
      failed = st;
      failure = msg;
    }
    op.w->external_done(st, msg);
  }
}

} // namespace libddp_torch
