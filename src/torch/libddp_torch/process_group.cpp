// ProcessGroupLibddp: see process_group.hpp and docs/torch.md.
#include "process_group.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <unistd.h>

#include "staging.hpp"
#include "store_bridge.hpp"

namespace libddp_torch {
namespace {

using c10d::OpType;
using c10d::ReduceOp;

std::string join_ints(const std::vector<int> &v) { // "1, 2, 3"
  std::string out;
  for (size_t i = 0; i < v.size(); i++) out += (i ? ", " : "") + std::to_string(v[i]);
  return out;
}

// libddp's dtypes for PyTorch's; false for dtypes that travel as bytes (bool among them:
// libddp's collectives move it as u8).
bool native_dtype(at::ScalarType t, ddp_dtype_t *dt) {
  switch (t) {
  case at::kFloat: *dt = DDP_F32; return true;
  case at::kDouble: *dt = DDP_F64; return true;
  case at::kHalf: *dt = DDP_F16; return true;
  case at::kBFloat16: *dt = DDP_BF16; return true;
  case at::kInt: *dt = DDP_I32; return true;
  case at::kLong: *dt = DDP_I64; return true;
  case at::kByte: *dt = DDP_U8; return true;
  default: return false;
  }
}

const char *op_name(const ReduceOp &op) {
  switch (op.op_) {
  case ReduceOp::SUM: return "SUM";
  case ReduceOp::AVG: return "AVG";
  case ReduceOp::PRODUCT: return "PRODUCT";
  case ReduceOp::MIN: return "MIN";
  case ReduceOp::MAX: return "MAX";
  case ReduceOp::BAND: return "BAND";
  case ReduceOp::BOR: return "BOR";
  case ReduceOp::BXOR: return "BXOR";
  case ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
  default: return "UNUSED";
  }
}

// "float[2, 3]": a tensor's dtype and shape, appended to s.
void append_tensor(std::string &s, const at::Tensor &t) {
  s += c10::toString(t.scalar_type());
  s += '[';
  for (int64_t i = 0; i < t.dim(); i++) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  s += ']';
}

std::string describe(const at::Tensor &t) {
  std::string s;
  append_tensor(s, t);
  return s;
}

// A call's name for its work's messages, "allreduce of float[4] (SUM)", built on every call
// and so in one allocation: the concatenations it replaced (and the op/dtype text that
// reduce_path now formats only for its errors) were a quarter of what the plugin adds to a
// 4-byte allreduce (1.13 against 0.85 us over libddp's own call, timed from C++).
std::string call_name(const char *kind, const at::Tensor &t, const ReduceOp *op = nullptr) {
  std::string s;
  s.reserve(64);
  s += kind;
  s += " of ";
  append_tensor(s, t);
  if (op) {
    s += " (";
    s += op_name(*op);
    s += ')';
  }
  return s;
}

// A tensor this backend can take: dense (or, where `sparse_ok`, sparse COO) and on the CPU,
// of any strides (staging.hpp). CUDA tensors name their device and the backend that takes
// them.
void check_tensor(const at::Tensor &t, const std::string &what, bool sparse_ok = false) {
  TORCH_CHECK(t.defined(), "libddp ", what, ": got an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "libddp ", what, ": the tensor is on ", t.device().str(),
              "; the libddp backend takes CPU tensors only (move it with .cpu(), or use the "
              "nccl backend for CUDA tensors)");
  if (sparse_ok && t.layout() == at::kSparse) return;
  TORCH_CHECK(t.layout() == at::kStrided, "libddp ", what, ": ", t.layout(), " tensors are not ",
              sparse_ok ? "supported (dense and sparse COO tensors only)"
                        : "supported here (dense tensors only; all_reduce also takes sparse COO)");
}

void check_one(const std::vector<at::Tensor> &v, const std::string &what) {
  TORCH_CHECK(v.size() == 1, "libddp ", what, ": expects a list of exactly one tensor, got ",
              v.size());
}

void check_same(const at::Tensor &a, const at::Tensor &b, const std::string &what,
                const char *how) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.numel() == b.numel(), "libddp ", what,
              ": ", how, ": ", describe(a), " against ", describe(b));
}

// How a reduction of this dtype and op runs: natively (libddp's kernels), as an allgather
// and a fold in rank order with ATen (dtypes and ops libddp's kernels lack), or not at all.
enum class Path { NATIVE, FOLD };

Path reduce_path(const at::Tensor &t, const ReduceOp &op, const std::string &what,
                 ddp_dtype_t *dt, ddp_redop_t *rop) {
  at::ScalarType st = t.scalar_type();
  bool is_float = at::isFloatingType(st);
  bool is_int = at::isIntegralType(st, /*includeBool=*/false);
  bool is_bool = st == at::kBool;
  bool bitwise = op.op_ == ReduceOp::BAND || op.op_ == ReduceOp::BOR || op.op_ == ReduceOp::BXOR;
  // Formatted only when a check fails (TORCH_CHECK evaluates its message then).
  auto combo = [&] {
    return std::string("ReduceOp.") + op_name(op) + " on a " + c10::toString(st) + " tensor";
  };
  TORCH_CHECK(op.op_ != ReduceOp::PREMUL_SUM && op.op_ != ReduceOp::UNUSED, "libddp ", what,
              ": ", combo(), " is not supported (PREMUL_SUM is NCCL's)");
  TORCH_CHECK(is_float || is_int || is_bool, "libddp ", what, ": ", combo(),
              " is not supported (reductions take floating-point, integer and bool tensors; "
              "complex tensors are reduced through torch.view_as_real)");
  TORCH_CHECK(!(bitwise && is_float), "libddp ", what, ": ", combo(),
              " is not supported (bitwise ops take integer and bool tensors)");
  TORCH_CHECK(op.op_ != ReduceOp::AVG || is_float, "libddp ", what, ": ", combo(),
              " is not supported (AVG takes floating-point tensors, as in NCCL)");
  if (is_bool) {
    // bool's sum and max are OR, its product and min AND, as in gloo: u8 MAX and MIN.
    if (op.op_ == ReduceOp::SUM || op.op_ == ReduceOp::MAX || op.op_ == ReduceOp::BOR) {
      *dt = DDP_U8, *rop = DDP_OP_MAX;
      return Path::NATIVE;
    }
    if (op.op_ == ReduceOp::PRODUCT || op.op_ == ReduceOp::MIN || op.op_ == ReduceOp::BAND) {
      *dt = DDP_U8, *rop = DDP_OP_MIN;
      return Path::NATIVE;
    }
    return Path::FOLD;
  }
  if (bitwise) return Path::FOLD;
  bool known = native_dtype(st, dt);
  if (!known && st == at::kChar && (op.op_ == ReduceOp::SUM || op.op_ == ReduceOp::PRODUCT)) {
    // Two's-complement sums and products wrap to the same bits as unsigned ones.
    *dt = DDP_U8, known = true;
  } else if (!known || (st == at::kChar)) {
    return Path::FOLD;
  }
  switch (op.op_) {
  case ReduceOp::SUM: *rop = DDP_OP_SUM; break;
  case ReduceOp::AVG: *rop = DDP_OP_AVG; break;
  case ReduceOp::PRODUCT: *rop = DDP_OP_PRODUCT; break;
  case ReduceOp::MIN: *rop = DDP_OP_MIN; break;
  case ReduceOp::MAX: *rop = DDP_OP_MAX; break;
  default: return Path::FOLD;
  }
  return Path::NATIVE;
}

at::Tensor combine(const at::Tensor &a, const at::Tensor &b, const ReduceOp &op) {
  switch (op.op_) {
  case ReduceOp::SUM: return a.scalar_type() == at::kBool ? at::logical_or(a, b) : at::add(a, b);
  case ReduceOp::PRODUCT:
    return a.scalar_type() == at::kBool ? at::logical_and(a, b) : at::mul(a, b);
  case ReduceOp::MIN: return at::minimum(a, b);
  case ReduceOp::MAX: return at::maximum(a, b);
  case ReduceOp::BAND: return at::bitwise_and(a, b);
  case ReduceOp::BOR: return at::bitwise_or(a, b);
  case ReduceOp::BXOR: return at::bitwise_xor(a, b);
  default: TORCH_CHECK(false, "libddp: no fold for ReduceOp.", op_name(op));
  }
}

// Element type and count libddp moves a tensor as: its own dtype where libddp has it (so the
// fingerprint names it), else bytes.
void wire_of(const at::Tensor &t, ddp_dtype_t *dt, size_t *count) {
  if (native_dtype(t.scalar_type(), dt)) {
    *count = static_cast<size_t>(t.numel());
  } else {
    *dt = DDP_U8;
    *count = static_cast<size_t>(t.numel()) * t.element_size();
  }
}

std::string read_boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string s;
  std::getline(f, s);
  return s;
}

std::string host_identity() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  return std::string(name) + "/" + read_boot_id();
}

std::string random_token() {
  std::random_device rd;
  std::ostringstream s;
  for (int i = 0; i < 4; i++) s << std::hex << rd();
  return s.str();
}

std::string get_string(c10d::Store &store, const std::string &key) {
  std::vector<uint8_t> v = store.get(key);
  return std::string(v.begin(), v.end());
}

void set_string(c10d::Store &store, const std::string &key, const std::string &v) {
  store.set(key, std::vector<uint8_t>(v.begin(), v.end()));
}

// Whether `key` appears in the store before `deadline`, polled with check() from 50 us to
// 10 ms apart. Not store.wait(keys, timeout): a wait that times out leaves its request
// pending at a TCPStore server, whose late answer 1.13's client then reads as the reply to
// its next request (and ddprun's store, as torchrun's agent store, holds the connection's
// next requests behind it).
bool poll_key(c10d::Store &store, const std::string &key,
              std::chrono::steady_clock::time_point deadline) {
  int sleep_us = 50;
  for (;;) {
    if (store.check({key})) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(sleep_us * 2, 10000);
  }
}

} // namespace

// ------------------------------------------------------------------ create / destroy --

ProcessGroupLibddp::ProcessGroupLibddp(const c10::intrusive_ptr<c10d::Store> &store, int rank,
                                       int size, std::chrono::milliseconds timeout,
                                       const Config &cfg)
    : c10d::ProcessGroup(rank, size), store_(store), timeout_ms_(timeout.count()) {
  TORCH_CHECK(store_, "libddp: no store was given (init_process_group needs an init_method, "
                      "a store, or MASTER_ADDR/MASTER_PORT in the environment)");
  // World sizes: every rank checks its own against rank 0's and says so, so both sides of
  // a disagreement fail at once naming both sizes instead of waiting for a rank that never
  // comes.
  set_string(*store_, "libddp/world/" + std::to_string(rank), std::to_string(size));
  std::string w0 = get_string(*store_, "libddp/world/0");
  if (rank == 0) {
    for (int r = 1; r < size; r++) {
      std::string wr = get_string(*store_, "libddp/world_ok/" + std::to_string(r));
      TORCH_CHECK(wr == "ok", "libddp: ", wr);
    }
  } else {
    std::string verdict = "ok";
    if (w0 != std::to_string(size)) {
      verdict = "the ranks disagree on the world size: rank " + std::to_string(rank) +
                " has world_size " + std::to_string(size) + ", rank 0 has " + w0;
    }
    set_string(*store_, "libddp/world_ok/" + std::to_string(rank), verdict);
    TORCH_CHECK(verdict == "ok", "libddp: ", verdict);
  }

  // The transport: the option, else DDP_BACKEND, else shm when every rank runs on this
  // host (same hostname and boot id), else tcp.
  std::string transport = cfg.transport, source = cfg.transport_source;
  if (transport == "auto") {
    const char *env = getenv("DDP_BACKEND");
    if (env && env[0]) transport = env, source = "DDP_BACKEND";
  }
  if (transport == "gloo") transport = "tcp";
  if (transport == "auto") {
    std::string me = host_identity();
    set_string(*store_, "libddp/host/" + std::to_string(rank), me);
    bool one_host = true;
    for (int r = 0; r < size; r++)
      one_host = one_host && get_string(*store_, "libddp/host/" + std::to_string(r)) == me;
    // Every rank must choose alike: rank 0's view decides for all.
    if (rank == 0) set_string(*store_, "libddp/transport", one_host ? "shm" : "tcp");
    transport = get_string(*store_, "libddp/transport");
    source = "auto";
  }
  TORCH_CHECK(transport == "shm" || transport == "tcp" || transport == "mpi", "libddp: unknown "
              "transport '", cfg.transport == "auto" ? transport : cfg.transport, "' (from ",
              source, "); the torch backend takes auto, shm, tcp (alias gloo) or mpi (threads "
              "ranks cannot be PyTorch ranks: one process is one rank)");
  TORCH_CHECK(transport != "mpi" || ddp_backend_find("mpi"), "libddp: transport 'mpi' (from ",
              source, ") is not built into this libddp; built: ", ddp_backend_names());
  transport_ = transport;
  group_buckets_ = cfg.group_buckets;

  // tcp connections present a job token: DDP_JOB_TOKEN (ddprun's) or one rank 0 draws.
  std::string token;
  const char *env_token = getenv("DDP_JOB_TOKEN");
  if (env_token && env_token[0]) {
    token = env_token;
  } else {
    if (rank == 0) set_string(*store_, "libddp/token", random_token());
    token = get_string(*store_, "libddp/token");
  }

  ddp_algorithm_t algo = DDP_ALGO_AUTO;
  if (cfg.algorithm == "canonical") algo = DDP_ALGO_CANONICAL;
  else if (cfg.algorithm == "ring") algo = DDP_ALGO_RING;
  else if (cfg.algorithm == "small") algo = DDP_ALGO_SMALL;
  else
    TORCH_CHECK(cfg.algorithm == "auto", "libddp: unknown algorithm '", cfg.algorithm,
                "' (auto, canonical, ring or small)");

  token_ = token;
  ddp_error_t err = {};
  ddp_store_t *ds = nullptr;
  ddp_status_t st = make_ddp_store(store_.get(), rank, timeout_ms_, &ds, &err);
  TORCH_CHECK(st == DDP_OK, "libddp: ", err.msg);
  ds_ = ds;
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = transport_.c_str();
  o.rank = rank;
  o.world = size;
  o.store = ds;
  o.timeout_ms = timeout_ms_;
  o.algorithm = algo;
  o.job_token = token.c_str();
  o.no_flight_recorder = !cfg.flight_recorder;
  o.defer_start = cfg.defer_start;
  st = ddp_pg_create(&o, &pg_, &err);
  if (st != DDP_OK) {
    ddp_store_destroy(ds_);
    ds_ = nullptr;
  }
  TORCH_CHECK(st == DDP_OK, "libddp: creating the ", transport_, " group of rank ", rank, " of ",
              size, " failed (", ddp_status_name(st), "): ", err.msg);
  pg_owner_ = std::shared_ptr<ddp_pg_t>(pg_, ddp_pg_destroy);
  completer_ = std::thread([this] { completer_main(); });
}

ProcessGroupLibddp::~ProcessGroupLibddp() {
  // Python usually drops the last reference (destroy_process_group, the object's dealloc)
  // holding the GIL, while the completer and channel threads joined below may need the GIL
  // to release a tensor or future that a Python object shares (the last reference to an
  // irecv's work, a comm hook's future): joining them with the GIL held deadlocked a rank
  // at exit (PyTorch's test_send_recv_any_source under CPU load). c10d's own bindings
  // release the GIL in their groups' destructors for the same reason.
  std::unique_ptr<pybind11::gil_scoped_release> nogil;
  if (Py_IsInitialized() && PyGILState_Check())
    nogil = std::make_unique<pybind11::gil_scoped_release>();
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (completer_.joinable()) completer_.join();
  channels_.clear();
  pg_owner_.reset(); /* the C group goes now, or with the last block of its memory in use */
  ddp_store_destroy(ds_);
}

P2PChannel &ProcessGroupLibddp::channel(int peer, bool is_send) {
  std::lock_guard<std::mutex> g(channels_mu_);
  auto &c = channels_[{peer, is_send}];
  if (!c) {
    ChannelSetup setup{transport_, token_, timeout_ms_, ds_};
    c = std::make_unique<P2PChannel>(setup, getRank(), peer, is_send);
  }
  return *c;
}

// The completer finishes works whose future was asked for (DDP's reducer and comm hooks
// wait on futures, not on works), in issue order, which is the order they end in.
namespace {
thread_local bool completer_thread = false;
// Completions queued or running on every group's completer, for quiesce(): process-wide,
// as the interpreter's exit that it guards is.
std::mutex busy_mu;
std::condition_variable busy_cv;
int64_t busy = 0;

void count_busy(int64_t d) {
  std::lock_guard<std::mutex> g(busy_mu);
  busy += d;
  if (busy == 0) busy_cv.notify_all();
}
} // namespace

bool ProcessGroupLibddp::on_completer_thread() { return completer_thread; }

void ProcessGroupLibddp::quiesce(int64_t timeout_ms) {
  std::unique_lock<std::mutex> g(busy_mu);
  busy_cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [] { return busy == 0; });
}

void ProcessGroupLibddp::completer_main() {
  completer_thread = true;
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    cv_.wait(g, [this] { return stop_ || !pending_.empty(); });
    if (pending_.empty()) return;
    c10::intrusive_ptr<WorkLibddp> w = pending_.front();
    pending_.pop_front();
    g.unlock();
    w->complete();
    w.reset(); /* the future's callbacks and their Python objects go here */
    count_busy(-1);
    g.lock();
  }
}

void ProcessGroupLibddp::enqueue_completion(c10::intrusive_ptr<WorkLibddp> w) {
  count_busy(1);
  {
    std::lock_guard<std::mutex> g(mu_);
    pending_.push_back(std::move(w));
  }
  cv_.notify_one();
}

void ProcessGroupLibddp::fail(const std::string &what, ddp_status_t st,
                              const std::string &msg) const {
  std::string m = msg;
  if (m.empty()) {
    ddp_error_t e = {};
    ddp_pg_last_error_copy(pg_, &e);
    m = e.msg[0] ? e.msg : ddp_status_str(st);
  }
  TORCH_CHECK(false, failure_text(what, getRank(), st, m));
}

void ProcessGroupLibddp::check_issue(ddp_status_t st, const std::string &what) const {
  if (st != DDP_OK) fail(what, st, "");
}

// A collective writes its outputs as data, below autograd, as gloo's and NCCL's memcpy do:
// every entry point holds a NoGradGuard for the copies it makes on the caller's thread, and
// WorkLibddp::finish one for those it makes when the data has arrived. A parameter (a leaf
// that requires grad) synced by hand can then be an output of any call, not only of those
// that write it through its pointer; its version counter still moves, so autograd still
// sees a tensor it saved being overwritten.
c10::intrusive_ptr<WorkLibddp> ProcessGroupLibddp::make_work(OpType type, std::string what,
                                                             std::vector<at::Tensor> outputs,
                                                             std::chrono::milliseconds timeout) {
  seq_++;
  int64_t t = timeout == c10d::kUnsetTimeout ? -1 : timeout.count();
  return c10::make_intrusive<WorkLibddp>(this, type, std::move(what), std::move(outputs), t);
}

// ------------------------------------------------------------------ reductions ---------

void ProcessGroupLibddp::issue_allreduce(WorkLibddp &w, at::Tensor t, ReduceOp op,
                                         const std::string &what) {
  ddp_dtype_t dt = DDP_F32;
  ddp_redop_t rop = DDP_OP_SUM;
  Path path = reduce_path(t, op, what, &dt, &rop);
  ddp_work_t *h = nullptr;
  if (path == Path::NATIVE) {
    check_issue(ddp_allreduce(pg_, t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), dt,
                              rop, &h),
                what);
    w.add_handle(h);
    w.keep(t);
    return;
  }
  // Every rank's values, then the fold in rank order: ((x0 op x1) op x2) ...
  at::Tensor all = at::empty({getSize(), t.numel()}, t.options());
  size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  check_issue(ddp_allgather(pg_, t.data_ptr(), all.data_ptr(), bytes, DDP_U8, &h), what);
  w.add_handle(h);
  w.keep(all);
  w.keep(t);
  int world = getSize();
  w.on_success([t, all, op, world]() mutable {
    at::Tensor acc = all[0];
    for (int r = 1; r < world; r++) acc = combine(acc, all[r], op);
    t.view({-1}).copy_(acc);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::allreduce(std::vector<at::Tensor> &tensors,
                                                             const c10d::AllreduceOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  TORCH_CHECK(!tensors.empty(), "libddp allreduce: got an empty tensor list");
  std::string what = call_name("allreduce", tensors[0], &opts.reduceOp);
  for (auto &t : tensors) {
    check_tensor(t, what, true);
    check_same(t, tensors[0], what, "the tensors of one call differ");
    TORCH_CHECK(t.layout() == tensors[0].layout(), "libddp ", what,
                ": the tensors of one call mix sparse and dense tensors");
  }
  if (tensors[0].layout() == at::kSparse) return allreduce_sparse(tensors, opts, what);
  auto w = make_work(OpType::ALLREDUCE, what, tensors, opts.timeout);
  Staging st;
  at::Tensor t0 = st.out(tensors[0], what);
  if (tensors.size() > 1) {
    // Several tensors of one rank: gloo's meaning, every tensor gets the reduction of all
    // of them on all ranks. They are folded locally in list order first.
    for (size_t i = 1; i < tensors.size(); i++)
      t0.copy_(combine(t0, tensors[i], opts.reduceOp));
  }
  issue_allreduce(*w, t0, opts.reduceOp, what);
  st.commit(*w);
  if (tensors.size() > 1) {
    std::vector<at::Tensor> ts = tensors;
    w->on_success([ts]() {
      for (size_t i = 1; i < ts.size(); i++) ts[i].copy_(ts[0]);
    });
  }
  return w;
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupLibddp::allreduce_coalesced(std::vector<at::Tensor> &tensors,
                                        const c10d::AllreduceCoalescedOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  TORCH_CHECK(!tensors.empty(), "libddp allreduce_coalesced: got an empty tensor list");
  std::string what = "allreduce_coalesced of " + std::to_string(tensors.size()) + " tensors (" +
                     op_name(opts.reduceOp) + ")";
  std::vector<at::Tensor> flat;
  for (auto &t : tensors) {
    check_tensor(t, what);
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), "libddp ", what,
                ": the tensors must share one dtype: ", describe(tensors[0]), " and ",
                describe(t));
    flat.push_back(t.reshape({-1}));
  }
  at::Tensor buf = at::cat(flat);
  auto w = make_work(OpType::ALLREDUCE_COALESCED, what, tensors, opts.timeout);
  issue_allreduce(*w, buf, opts.reduceOp, what);
  std::vector<at::Tensor> ts = tensors;
  w->on_success([ts, buf]() {
    int64_t off = 0;
    for (auto &t : ts) { // t may be any view: copy_ follows its strides
      t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  });
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::reduce(std::vector<at::Tensor> &tensors,
                                                          const c10d::ReduceOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  check_one(tensors, "reduce");
  at::Tensor t = tensors[0];
  std::string what = "reduce of " + describe(t) + " (" + op_name(opts.reduceOp) + ") to root " +
                     std::to_string(opts.rootRank);
  check_tensor(t, what);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "libddp ", what,
              ": root rank out of range [0, ", getSize(), ")");
  auto w = make_work(OpType::REDUCE, what, tensors, opts.timeout);
  // An allreduce, into a scratch copy on the other ranks: their tensors stay as they were.
  Staging st;
  issue_allreduce(*w, getRank() == opts.rootRank ? st.out(t, what) : t.clone(at::MemoryFormat::Contiguous),
                  opts.reduceOp, what);
  st.commit(*w);
  return w;
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupLibddp::reduce_scatter(std::vector<at::Tensor> &outputs,
                                   std::vector<std::vector<at::Tensor>> &inputs,
                                   const c10d::ReduceScatterOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  check_one(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
              "libddp reduce_scatter: expects one list of world_size (", getSize(),
              ") input tensors");
  at::Tensor out = outputs[0];
  std::string what = call_name("reduce_scatter", out, &opts.reduceOp);
  check_tensor(out, what);
  std::vector<at::Tensor> flat;
  for (auto &t : inputs[0]) {
    check_tensor(t, what);
    check_same(t, out, what, "an input differs from the output");
    flat.push_back(t.reshape({-1}));
  }
  at::Tensor buf = at::cat(flat);
  return _reduce_scatter_base(out, buf, opts); // stages `out` if it is a view
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupLibddp::_reduce_scatter_base(at::Tensor &output, at::Tensor &input,
                                         const c10d::ReduceScatterOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  std::string what =
      "reduce_scatter_tensor of " + describe(input) + " (" + op_name(opts.reduceOp) + ")";
  check_tensor(output, what);
  check_tensor(input, what);
  TORCH_CHECK(input.scalar_type() == output.scalar_type() &&
                  input.numel() == output.numel() * getSize(),
              "libddp ", what, ": the input must hold world_size (", getSize(),
              ") times the output's elements, of the same dtype: input ", describe(input),
              ", output ", describe(output));
  auto w = make_work(OpType::REDUCE_SCATTER, what, {output}, opts.timeout);
  Staging st;
  at::Tensor in = Staging::in(input), out = st.out(output, what, false);
  ddp_dtype_t dt = DDP_F32;
  ddp_redop_t rop = DDP_OP_SUM;
  if (reduce_path(in, opts.reduceOp, what, &dt, &rop) == Path::NATIVE) {
    ddp_work_t *h = nullptr;
    check_issue(ddp_reduce_scatter(pg_, in.data_ptr(), out.data_ptr(),
                                   static_cast<size_t>(out.numel()), dt, rop, &h),
                what);
    w->add_handle(h);
    w->keep(in);
    w->keep(out);
    st.commit(*w);
    return w;
  }
  at::Tensor all = in.clone();
  issue_allreduce(*w, all, opts.reduceOp, what);
  int64_t n = out.numel(), r = getRank();
  w->on_success([all, out, n, r]() mutable { out.view({-1}).copy_(all.view({-1}).narrow(0, r * n, n)); });
  st.commit(*w);
  return w;
}

// ------------------------------------------------------------------ data movement ------

// The allgather every gathering call runs: `out` (contiguous, world_size times `in`'s bytes)
// receives every rank's `in` in rank order; both stay alive until the work ends.
void ProcessGroupLibddp::issue_allgather(WorkLibddp &w, const at::Tensor &in,
                                         const at::Tensor &out, const std::string &what) {
  ddp_dtype_t dt;
  size_t count;
  wire_of(in, &dt, &count);
  ddp_work_t *h = nullptr;
  check_issue(ddp_allgather(pg_, in.data_ptr(), out.data_ptr(), count, dt, &h), what);
  w.add_handle(h);
  w.keep(in);
  w.keep(out);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::broadcast(std::vector<at::Tensor> &tensors,
                                                             const c10d::BroadcastOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  TORCH_CHECK(!tensors.empty(), "libddp broadcast: got an empty tensor list");
  std::string what =
      "broadcast of " + describe(tensors[0]) + " from root " + std::to_string(opts.rootRank);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "libddp ", what,
              ": root rank out of range [0, ", getSize(), ")");
  auto w = make_work(OpType::BROADCAST, what, tensors, opts.timeout);
  Staging st;
  for (auto &view : tensors) {
    check_tensor(view, what);
    at::Tensor t = st.out(view, what, getRank() == opts.rootRank);
    ddp_dtype_t dt;
    size_t count;
    wire_of(t, &dt, &count);
    ddp_work_t *h = nullptr;
    check_issue(ddp_broadcast(pg_, t.data_ptr(), count, dt, static_cast<int>(opts.rootRank), &h),
                what);
    w->add_handle(h);
    w->keep(t);
  }
  st.commit(*w);
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::_allgather_base(at::Tensor &output,
                                                                   at::Tensor &input,
                                                                   const c10d::AllgatherOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  std::string what = call_name("allgather_into_tensor", input);
  check_tensor(output, what);
  check_tensor(input, what);
  TORCH_CHECK(input.scalar_type() == output.scalar_type() &&
                  output.numel() == input.numel() * getSize(),
              "libddp ", what, ": the output must hold world_size (", getSize(),
              ") times the input's elements, of the same dtype: input ", describe(input),
              ", output ", describe(output));
  auto w = make_work(OpType::_ALLGATHER_BASE, what, {output}, opts.timeout);
  Staging st;
  issue_allgather(*w, Staging::in(input), st.out(output, what, false), what);
  st.commit(*w);
  return w;
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupLibddp::allgather(std::vector<std::vector<at::Tensor>> &outputs,
                              std::vector<at::Tensor> &inputs, const c10d::AllgatherOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  check_one(inputs, "allgather");
  at::Tensor in = inputs[0];
  std::string what = call_name("allgather", in);
  check_tensor(in, what);
  in = Staging::in(in);
  TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
              "libddp ", what, ": expects one output list of world_size (", getSize(),
              ") tensors");
  for (auto &o : outputs[0]) {
    check_tensor(o, what);
    check_same(o, in, what, "an output differs from the input");
  }
  at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
  auto w = make_work(OpType::ALLGATHER, what, outputs[0], opts.timeout);
  issue_allgather(*w, in, flat, what);
  std::vector<at::Tensor> outs = outputs[0];
  int64_t n = in.numel();
  w->on_success([outs, flat, n]() {
    for (size_t r = 0; r < outs.size(); r++)
      outs[r].view_as(outs[r]).copy_(flat.narrow(0, r * n, n).view(outs[r].sizes()));
  });
  return w;
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupLibddp::allgather_coalesced(std::vector<std::vector<at::Tensor>> &outputs,
                                        std::vector<at::Tensor> &inputs,
                                        const c10d::AllgatherOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  std::string what = "allgather_coalesced of " + std::to_string(inputs.size()) + " tensors";
  TORCH_CHECK(!inputs.empty(), "libddp ", what, ": got an empty input list");
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "libddp ", what,
              ": expects world_size (", getSize(), ") output lists, got ", outputs.size());
  std::vector<at::Tensor> flat_in;
  for (auto &t : inputs) {
    check_tensor(t, what);
    TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), "libddp ", what,
                ": the tensors must share one dtype: ", describe(inputs[0]), " and ",
                describe(t));
    flat_in.push_back(t.reshape({-1}));
  }
  for (auto &list : outputs) {
    TORCH_CHECK(list.size() == inputs.size(), "libddp ", what, ": every output list must hold ",
                inputs.size(), " tensors, one holds ", list.size());
    for (size_t i = 0; i < list.size(); i++) {
      check_tensor(list[i], what);
      check_same(list[i], inputs[i], what, "an output differs from its input");
    }
  }
  at::Tensor in = at::cat(flat_in);
  at::Tensor all = at::empty({getSize() * in.numel()}, in.options());
  std::vector<at::Tensor> flat_out;
  for (auto &l : outputs) flat_out.insert(flat_out.end(), l.begin(), l.end());
  auto w = make_work(OpType::ALLGATHER_COALESCED, what, flat_out, opts.timeout);
  issue_allgather(*w, in, all, what);
  std::vector<std::vector<at::Tensor>> outs = outputs;
  int64_t n = in.numel();
  w->on_success([outs, all, n]() {
    for (size_t r = 0; r < outs.size(); r++) {
      int64_t off = static_cast<int64_t>(r) * n;
      for (auto &t : outs[r]) {
        t.copy_(all.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    }
  });
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::gather(std::vector<std::vector<at::Tensor>> &outputs,
                                                          std::vector<at::Tensor> &inputs,
                                                          const c10d::GatherOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  check_one(inputs, "gather");
  at::Tensor in = inputs[0];
  std::string what = "gather of " + describe(in) + " to root " + std::to_string(opts.rootRank);
  check_tensor(in, what);
  in = Staging::in(in);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "libddp ", what,
              ": root rank out of range [0, ", getSize(), ")");
  bool root = getRank() == opts.rootRank;
  if (root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "libddp ", what, ": the root expects one output list of world_size (", getSize(),
                ") tensors");
    for (auto &o : outputs[0]) {
      check_tensor(o, what);
      check_same(o, in, what, "an output differs from the input");
    }
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "libddp ", what,
                ": only the root takes output tensors");
  }
  // An allgather: every rank's share in one step, the root keeps them.
  at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
  auto w = make_work(OpType::GATHER, what, root ? outputs[0] : std::vector<at::Tensor>{},
                     opts.timeout);
  issue_allgather(*w, in, flat, what);
  if (root) {
    std::vector<at::Tensor> outs = outputs[0];
    int64_t n = in.numel();
    w->on_success([outs, flat, n]() {
      for (size_t r = 0; r < outs.size(); r++)
        outs[r].copy_(flat.narrow(0, r * n, n).view(outs[r].sizes()));
    });
  }
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::scatter(std::vector<at::Tensor> &outputs,
                                                           std::vector<std::vector<at::Tensor>> &inputs,
                                                           const c10d::ScatterOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  check_one(outputs, "scatter");
  at::Tensor out = outputs[0];
  std::string what = "scatter of " + describe(out) + " from root " + std::to_string(opts.rootRank);
  check_tensor(out, what);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "libddp ", what,
              ": root rank out of range [0, ", getSize(), ")");
  int root = static_cast<int>(opts.rootRank);
  auto w = make_work(OpType::SCATTER, what, outputs, opts.timeout);
  ddp_dtype_t dt;
  size_t count;
  wire_of(out, &dt, &count);
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "libddp ",
                what, ": the root expects one input list of world_size (", getSize(),
                ") tensors");
    for (const at::Tensor &t : inputs[0]) { // all checked before anything is sent
      check_tensor(t, what);
      check_same(t, out, what, "an input differs from the output");
    }
    // The root sends each rank its share, point to point, in rank order.
    for (int r = 0; r < getSize(); r++) {
      if (r == root) continue;
      at::Tensor c = inputs[0][r].contiguous();
      ddp_work_t *h = nullptr;
      check_issue(ddp_send(pg_, c.data_ptr(), count, dt, r, &h), what);
      w->add_handle(h);
      w->keep(c);
    }
    at::Tensor mine = inputs[0][root];
    w->on_success([out, mine]() mutable { out.copy_(mine); });
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "libddp ", what,
                ": only the root takes input tensors");
    Staging st;
    at::Tensor o = st.out(out, what, false);
    ddp_work_t *h = nullptr;
    check_issue(ddp_recv(pg_, o.data_ptr(), count, dt, root, &h), what);
    w->add_handle(h);
    w->keep(o);
    st.commit(*w);
  }
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::alltoall_base(at::Tensor &output_view,
                                                                 at::Tensor &input_view,
                                                                 std::vector<int64_t> &output_splits,
                                                                 std::vector<int64_t> &input_splits,
                                                                 const c10d::AllToAllOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  std::string what = call_name("all_to_all_single", input_view);
  check_tensor(output_view, what);
  check_tensor(input_view, what);
  TORCH_CHECK(input_view.scalar_type() == output_view.scalar_type(), "libddp ", what,
              ": input and output dtypes differ: ", describe(input_view), " and ",
              describe(output_view));
  int W = getSize();
  auto w = make_work(OpType::ALLTOALL_BASE, what, {output_view}, opts.timeout);
  Staging st;
  at::Tensor input = Staging::in(input_view), output = st.out(output_view, what, false);
  int64_t rows_in = input.dim() ? input.size(0) : 1, rows_out = output.dim() ? output.size(0) : 1;
  int64_t row = rows_in ? input.numel() / rows_in : 0;
  auto even = [W](const std::vector<int64_t> &s, int64_t rows) {
    if (s.empty()) return rows % W == 0;
    for (int64_t v : s)
      if (v != s[0]) return false;
    return true;
  };
  std::vector<int64_t> in_s = input_splits, out_s = output_splits;
  TORCH_CHECK(in_s.empty() || static_cast<int>(in_s.size()) == W, "libddp ", what,
              ": input_split_sizes must have world_size (", W, ") entries");
  TORCH_CHECK(out_s.empty() || static_cast<int>(out_s.size()) == W, "libddp ", what,
              ": output_split_sizes must have world_size (", W, ") entries");
  if (in_s.empty()) {
    TORCH_CHECK(rows_in % W == 0, "libddp ", what, ": dim 0 (", rows_in,
                ") does not divide by world_size (", W, ") and no split sizes were given");
    in_s.assign(W, rows_in / W);
  }
  if (out_s.empty()) {
    TORCH_CHECK(rows_out % W == 0, "libddp ", what, ": dim 0 (", rows_out,
                ") does not divide by world_size (", W, ") and no split sizes were given");
    out_s.assign(W, rows_out / W);
  }
  int64_t sum_in = 0, sum_out = 0;
  for (int r = 0; r < W; r++) sum_in += in_s[r], sum_out += out_s[r];
  TORCH_CHECK(sum_in == rows_in && sum_out == rows_out, "libddp ", what,
              ": the split sizes add up to ", sum_in, " input and ", sum_out,
              " output rows, the tensors have ", rows_in, " and ", rows_out);
  ddp_work_t *h = nullptr;
  if (even(in_s, rows_in) && even(out_s, rows_out) && in_s[0] == out_s[0]) {
    // Equal blocks everywhere on this rank; the fingerprint catches a peer that disagrees.
    ddp_dtype_t dt;
    size_t count;
    wire_of(input.narrow(0, 0, in_s[0]), &dt, &count);
    check_issue(ddp_alltoall(pg_, input.data_ptr(), output.data_ptr(), count, dt, &h), what);
    w->add_handle(h);
    w->keep(input);
    w->keep(output);
    st.commit(*w);
    return w;
  }
  // Uneven blocks: every block padded to the largest of the job (one small allreduce to
  // agree on it), one alltoall, then the blocks unpacked.
  int64_t most = 0;
  for (int r = 0; r < W; r++) most = std::max({most, in_s[r], out_s[r]});
  check_issue(ddp_allreduce(pg_, &most, &most, 1, DDP_I64, DDP_OP_MAX, nullptr), what);
  at::Tensor send = at::zeros({W, most * row}, input.options());
  at::Tensor recvb = at::empty({W, most * row}, input.options());
  int64_t off = 0;
  at::Tensor in_flat = input.view({-1});
  for (int r = 0; r < W; r++) {
    send[r].narrow(0, 0, in_s[r] * row).copy_(in_flat.narrow(0, off, in_s[r] * row));
    off += in_s[r] * row;
  }
  ddp_dtype_t dt;
  size_t count;
  wire_of(send[0], &dt, &count);
  check_issue(ddp_alltoall(pg_, send.data_ptr(), recvb.data_ptr(), count, dt, &h), what);
  w->add_handle(h);
  w->keep(send);
  w->keep(recvb);
  at::Tensor out = output;
  w->on_success([out, recvb, out_s, row, W]() mutable {
    at::Tensor of = out.view({-1});
    int64_t o = 0;
    for (int r = 0; r < W; r++) {
      of.narrow(0, o, out_s[r] * row).copy_(recvb[r].narrow(0, 0, out_s[r] * row));
      o += out_s[r] * row;
    }
  });
  st.commit(*w);
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::alltoall(std::vector<at::Tensor> &outputs,
                                                            std::vector<at::Tensor> &inputs,
                                                            const c10d::AllToAllOptions &opts) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  int W = getSize();
  std::string what = "all_to_all of " + std::to_string(inputs.size()) + " tensors";
  TORCH_CHECK(static_cast<int>(inputs.size()) == W && static_cast<int>(outputs.size()) == W,
              "libddp ", what, ": expects world_size (", W, ") input and output tensors, got ",
              inputs.size(), " and ", outputs.size());
  int64_t most = 0;
  for (int r = 0; r < W; r++) {
    check_tensor(inputs[r], what);
    check_tensor(outputs[r], what);
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                "libddp ", what, ": the tensors must share one dtype: ", describe(inputs[0]),
                " and ", describe(inputs[r]), " / ", describe(outputs[r]));
    most = std::max({most, inputs[r].numel(), outputs[r].numel()});
  }
  auto w = make_work(OpType::ALLTOALL, what, outputs, opts.timeout);
  check_issue(ddp_allreduce(pg_, &most, &most, 1, DDP_I64, DDP_OP_MAX, nullptr), what);
  at::Tensor send = at::zeros({W, most}, inputs[0].options());
  at::Tensor recvb = at::empty({W, most}, inputs[0].options());
  for (int r = 0; r < W; r++)
    send[r].narrow(0, 0, inputs[r].numel()).copy_(inputs[r].reshape({-1}));
  ddp_dtype_t dt;
  size_t count;
  wire_of(send[0], &dt, &count);
  ddp_work_t *h = nullptr;
  check_issue(ddp_alltoall(pg_, send.data_ptr(), recvb.data_ptr(), count, dt, &h), what);
  w->add_handle(h);
  w->keep(send);
  w->keep(recvb);
  std::vector<at::Tensor> outs = outputs;
  w->on_success([outs, recvb]() {
    for (size_t r = 0; r < outs.size(); r++)
      outs[r].copy_(recvb[r].narrow(0, 0, outs[r].numel()).view(outs[r].sizes()));
  });
  return w;
}

// ------------------------------------------------------------------ point to point -----

// One point-to-point transfer with `peer`, queued on that direction's channel (p2p.hpp).
c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::p2p(std::vector<at::Tensor> &tensors, int peer,
                                                       bool is_send) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  const char *name = is_send ? "send" : "recv";
  check_one(tensors, name);
  at::Tensor t = tensors[0];
  std::string what = std::string(name) + " of " + describe(t) + (is_send ? " to" : " from") +
                     " rank " + std::to_string(peer);
  check_tensor(t, what);
  TORCH_CHECK(peer >= 0 && peer < getSize() && peer != getRank(), "libddp ", what, ": the ",
              is_send ? "destination" : "source", " must be another rank of the group [0, ",
              getSize(), ")");
  auto w = make_work(is_send ? OpType::SEND : OpType::RECV, what, tensors, c10d::kUnsetTimeout);
  w->set_external();
  Staging st;
  t = is_send ? Staging::in(t) : st.out(t, what, false);
  st.commit(*w);
  w->keep(t);
  if (is_send) {
    store_->add(sent_key(getRank(), peer), 1); // for a receive from any source (p2p.hpp)
  } else {
    w->set_source_rank(peer);
    std::lock_guard<std::mutex> g(channels_mu_);
    taken_[peer]++;
  }
  channel(peer, is_send).post(t, w);
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::send(std::vector<at::Tensor> &tensors, int dst,
                                                        int tag) {
  return p2p(tensors, dst, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::recv(std::vector<at::Tensor> &tensors, int src,
                                                        int tag) {
  return p2p(tensors, src, false);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::recvAnysource(std::vector<at::Tensor> &tensors,
                                                                 int tag) {
  at::NoGradGuard no_grad; // outputs are written as data: see make_work
  check_one(tensors, "recv");
  at::Tensor t = tensors[0];
  std::string what = "recv of " + describe(t) + " from any source";
  check_tensor(t, what);
  TORCH_CHECK(getSize() > 1, "libddp ", what, ": no other rank in the group");
  // Wait for the first rank whose announced sends are ahead of what was taken from it
  // (p2p.hpp), then receive from it as recv(src) does.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
  int sleep_us = 50;
  for (;;) {
    for (int src = 0; src < getSize(); src++) {
      if (src == getRank()) continue;
      int64_t sent = store_->add(sent_key(src, getRank()), 0);
      int64_t taken;
      {
        std::lock_guard<std::mutex> g(channels_mu_);
        taken = taken_[src];
      }
      if (sent > taken) {
        auto w = recv(tensors, src, tag);
        return w;
      }
    }
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "libddp ", what, " on rank ",
                getRank(), ": no rank sent to this rank within the timeout (", timeout_ms_,
                " ms)");
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(sleep_us * 2, 10000);
  }
}

// ------------------------------------------------------------------ barriers -----------

c10::intrusive_ptr<c10d::Work> ProcessGroupLibddp::barrier(const c10d::BarrierOptions &opts) {
  auto w = make_work(OpType::BARRIER, "barrier", {}, opts.timeout);
  ddp_work_t *h = nullptr;
  check_issue(ddp_barrier(pg_, &h), "barrier");
  w->add_handle(h);
  return w;
}

// gloo's monitored barrier, through the store, with gloo's messages (scripts and PyTorch's
// suite match them): every rank checks in, rank 0 waits for each in turn and names the first
// that did not come (wait_all_ranks: every one, each given the whole timeout), then posts its
// verdict, which releases the others or fails them. Unlike gloo's, a failing rank 0 still
// posts it, so the others fail at once instead of at their own timeout; they wait for it up
// to the barrier's timeout plus the group's. The group's collectives are not involved, so a
// missing rank does not fail the group.
void ProcessGroupLibddp::monitoredBarrier(const c10d::BarrierOptions &opts, bool wait_all_ranks) {
  int64_t ms = opts.timeout == c10d::kUnsetTimeout ? timeout_ms_ : opts.timeout.count();
  std::string base = "libddp/monitored_barrier/" + std::to_string(monitored_++) + "/";
  std::chrono::milliseconds t(ms);
  auto start = std::chrono::steady_clock::now();
  if (getRank() != 0) {
    set_string(*store_, base + std::to_string(getRank()), "1");
    std::string verdict = "no verdict from rank 0 within " +
                          std::to_string(ms + timeout_ms_) + " ms";
    if (poll_key(*store_, base + "done", start + t + std::chrono::milliseconds(timeout_ms_)))
      verdict = get_string(*store_, base + "done");
    TORCH_CHECK(verdict == "ok", "Rank ", getRank(),
                " successfully reached monitoredBarrier, but received errors while waiting for "
                "send/recv from rank 0. Please check rank 0 logs for faulty rank. (rank 0: ",
                verdict, ")");
    return;
  }
  std::vector<int> came, missing;
  std::string verdict;
  for (int r = 1; r < getSize() && verdict.empty(); r++) {
    auto left = wait_all_ranks ? t
                               : t - std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::steady_clock::now() - start);
    if (left.count() <= 0) { // gloo checks the time left before each rank
      std::ostringstream s;
      s << "Rank 0 timed out in monitoredBarrier after " << ms << " ms.\n";
      if (came.empty()) s << "No ranks successfully processed in monitoredBarrier.";
      else s << "Successfully processed ranks: " << join_ints(came);
      verdict = s.str();
      break;
    }
    if (poll_key(*store_, base + std::to_string(r), std::chrono::steady_clock::now() + left)) {
      came.push_back(r);
    } else {
      missing.push_back(r);
      if (!wait_all_ranks)
        verdict = "[Rank 0]: Rank " + std::to_string(r) + " failed to pass monitoredBarrier in " +
                  std::to_string(ms) + " ms";
    }
  }
  if (verdict.empty() && !missing.empty())
    verdict = "[Rank 0]: Ranks " + join_ints(missing) + " failed to pass monitoredBarrier in " +
              std::to_string(ms) + " ms";
  if (verdict.empty()) verdict = "ok";
  set_string(*store_, base + "done", verdict);
  TORCH_CHECK(verdict == "ok", verdict);
}

} // namespace libddp_torch
