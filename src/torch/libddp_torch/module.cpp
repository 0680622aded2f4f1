// The Python module libddp_torch._C: the group class and its factory; libddp_torch/__init__.py
// registers the factory with torch.distributed (docs/torch.md).
#include <c10/core/CPUAllocator.h>
#include <sys/statvfs.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "process_group.hpp"

namespace py = pybind11;
using libddp_torch::Config;
using libddp_torch::ProcessGroupLibddp;

namespace {

// The context of a DataPtr to a block of a group's memory: the C group stays alive as long
// as the block, which goes back to it when the storage dies (ProcessGroupLibddp::pg_owner
// says why the block holds the C group rather than the torch group).
struct GroupBlock {
  std::shared_ptr<ddp_pg_t> pg;
  void *p;
};

void free_group_block(void *ctx) {
  auto *b = static_cast<GroupBlock *>(ctx);
  ddp_pg_free(b->pg.get(), b->p);
  delete b;
}

// nbytes of the group's memory as a CPU DataPtr; empty, with the reason in *why, when the
// group has none to give (on shm: /dev/shm is full).
c10::DataPtr group_memory(const c10::intrusive_ptr<ProcessGroupLibddp> &pg, size_t nbytes,
                          std::string *why) {
  if (nbytes == 0) return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
  void *p = ddp_pg_alloc(pg->pg(), nbytes);
  if (!p) {
    ddp_error_t e = {};
    ddp_pg_last_error_copy(pg->pg(), &e);
    *why = e.msg[0] ? e.msg : "out of memory";
    return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
  }
  return c10::DataPtr(p, new GroupBlock{pg->pg_owner(), p}, &free_group_block,
                      c10::Device(c10::kCPU));
}

bool in_group_memory(const c10::intrusive_ptr<ProcessGroupLibddp> &pg, const at::Tensor &t) {
  if (!t.has_storage()) return false;
  const c10::DataPtr &dp = t.storage().data_ptr();
  return dp.get_deleter() == &free_group_block &&
         static_cast<GroupBlock *>(dp.get_context())->pg.get() == pg->pg();
}

// Moves t's whole storage into pg's memory, where its collectives read the peers' memory in
// place (shm), as Tensor.share_memory_() moves a storage into shared memory (it swaps the
// storage's DataPtr the same way): every tensor that views the storage follows; raw pointers
// taken from it before (tensor.numpy(), data_ptr()) do not, which is why it is the caller's
// choice. Only storages the CPU allocator gave the tensor move: memory that numpy, from_blob
// or a shared mapping lent it belongs to the lender. "" when the storage is in pg's memory
// afterwards or there is nothing to gain (tcp: ordinary memory), else why it stays.
std::string move_to_group_memory(const c10::intrusive_ptr<ProcessGroupLibddp> &pg,
                                 const at::Tensor &t) {
  if (!t.device().is_cpu())
    return "the tensor is on " + t.device().str() + "; only CPU tensors live in a group's memory";
  if (!t.has_storage()) return "the tensor has no storage of its own (sparse, or a wrapper)";
  if (in_group_memory(pg, t) || pg->transport() != "shm") return "";
  c10::StorageImpl *s = t.storage().unsafeGetStorageImpl();
  const c10::DataPtr &dp = s->data_ptr();
  if (dp.get_deleter() == &free_group_block) return "the tensor is in another libddp group's memory";
  if (s->nbytes() == 0) return "";
  c10::DeleterFnPtr own = c10::GetCPUAllocator()->raw_deleter();
  if (!own || dp.get_deleter() != own)
    return "the tensor's memory is lent to it (torch.from_numpy, from_blob, a shared mapping) "
           "and stays with its owner; copy it into libddp_torch.empty(...) instead";
  std::string why;
  c10::DataPtr moved = group_memory(pg, s->nbytes(), &why);
  if (!moved) return why;
  std::memcpy(moved.get(), s->data(), s->nbytes());
  s->set_data_ptr_noswap(std::move(moved));
  return "";
}

// DDP's buckets, born in the group's memory. While a libddp_torch reducer (__init__.py) of a
// shm group builds its buckets (the Reducer's constructor, _rebuild_buckets) on this thread,
// the CPU allocator hands out the group's memory, so DDP's default reduction then reads the
// peers' buckets in place with no staging copy, the way libddp_torch.allreduce_hook gets
// there by moving each bucket. Nothing moves: no pointer anyone holds changes, which is what
// makes it safe to do without asking. Every other allocation, on every thread, and one the
// group cannot hold (its memory is full) goes to the allocator that was there before, which
// also keeps its raw deleter, so "memory the CPU allocator gave" still means what it did.
class BucketAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) const override {
    if (window && n > 0) {
      // A full /dev/shm is not an error here, only the slower path: asked anyway, the shm
      // backend would log one per bucket. Said once, with what to do about it. Every rank
      // makes its bucket at about the same moment, so room for all of them is asked for.
      struct statvfs v;
      unsigned long long free_bytes = ~0ull;
      if (statvfs("/dev/shm", &v) == 0) free_bytes = (unsigned long long)v.f_bavail * v.f_frsize;
      if (free_bytes >= (unsigned long long)n * window->getSize() + (1u << 20)) {
        std::string why;
        c10::DataPtr dp = group_memory(window, n, &why);
        if (dp) return dp;
      } else {
        TORCH_WARN_ONCE("libddp: DDP's bucket of ", n, " bytes is made in ordinary memory and "
                        "reduced through the staging area, since /dev/shm has ", free_bytes,
                        " bytes free (enlarge /dev/shm, or pass libddp_torch.Options("
                        "bucket_memory=\"ordinary\") to choose this)");
      }
    }
    return base->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return base->raw_deleter(); }

  c10::Allocator *base = nullptr;
  // The group whose reducer is building buckets on this thread; the caller holds it.
  static thread_local c10::intrusive_ptr<ProcessGroupLibddp> window;
};
thread_local c10::intrusive_ptr<ProcessGroupLibddp> BucketAllocator::window;

// Opens this thread's window on pg. False where it cannot work: not shm, or a CPU allocator
// of higher priority was set before libddp's could be (then buckets are staged, as before).
bool open_bucket_window(const c10::intrusive_ptr<ProcessGroupLibddp> &pg) {
  static BucketAllocator alloc;
  static std::once_flag installed;
  std::call_once(installed, [] {
    alloc.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&alloc, /*priority=*/0);
  });
  BucketAllocator::window.reset();
  if (!pg->group_buckets() || c10::GetCPUAllocator() != &alloc) return false;
  BucketAllocator::window = pg;
  return true;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  // c10d's ProcessGroup and Store classes are registered by torch.distributed.
  py::module::import("torch.distributed");
  py::class_<ProcessGroupLibddp, c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupLibddp>>(
      m, "ProcessGroupLibddp")
      .def_property_readonly("transport", &ProcessGroupLibddp::transport,
                             "The libddp transport this group runs on: shm, tcp or mpi.")
      .def_property_readonly(
          "bucket_memory",
          [](const ProcessGroupLibddp &pg) { return pg.group_buckets() ? "group" : "ordinary"; },
          "Where DDP's reducer builds its buckets on this group: \"group\" (its shared "
          "memory; shm) or \"ordinary\".");
  m.def(
      "create",
      [](const c10::intrusive_ptr<c10d::Store> &store, int rank, int size, int64_t timeout_ms,
         const std::string &transport, const std::string &source, const std::string &algorithm,
         bool flight_recorder, bool defer_start, bool group_buckets) {
        Config cfg;
        cfg.group_buckets = group_buckets;
        cfg.flight_recorder = flight_recorder;
        cfg.defer_start = defer_start;
        cfg.transport = transport;
        cfg.transport_source = source;
        cfg.algorithm = algorithm;
        return c10::make_intrusive<ProcessGroupLibddp>(
            store, rank, size, std::chrono::milliseconds(timeout_ms), cfg);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"),
      py::arg("transport"), py::arg("source"), py::arg("algorithm"),
      py::arg("flight_recorder") = true, py::arg("defer_start") = true,
      py::arg("group_buckets") = true,
      py::call_guard<py::gil_scoped_release>());
  // A tensor of nbytes bytes in the group's communication memory (ddp_pg_alloc: on shm the
  // shared segment, which peers read in place, so a collective on it skips the staging
  // copies). The storage keeps the group alive and goes back to it when the tensor dies.
  m.def(
      "alloc",
      [](const c10::intrusive_ptr<ProcessGroupLibddp> &pg, int64_t nbytes) {
        TORCH_CHECK(nbytes >= 0, "libddp_torch.empty: ", nbytes, " bytes");
        std::string why;
        c10::DataPtr dp = group_memory(pg, static_cast<size_t>(nbytes), &why);
        TORCH_CHECK(dp || nbytes == 0, "libddp_torch.empty: ", why);
        c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                             std::move(dp), nullptr, false);
        return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {nbytes}, {1});
      },
      py::arg("group"), py::arg("nbytes"));
  // Registered with atexit by libddp_torch (ProcessGroupLibddp::quiesce says why).
  m.def("_quiesce", &ProcessGroupLibddp::quiesce, py::arg("timeout_ms"),
        py::call_guard<py::gil_scoped_release>());
  // libddp_torch's reducer: this thread's allocations in the group's memory while it builds
  // DDP's buckets (BucketAllocator above).
  m.def("_open_bucket_window", &open_bucket_window, py::arg("group"));
  m.def("_close_bucket_window", [] { BucketAllocator::window.reset(); });
  // libddp_torch.to_group_memory_ and allreduce_hook: "" or why the storage stays.
  m.def("move_to_group_memory", &move_to_group_memory, py::arg("group"), py::arg("tensor"));
  m.def("in_group_memory", &in_group_memory, py::arg("group"), py::arg("tensor"));
  // For tools/bench/bench_torch.py: times `iters` blocking all-reduces (SUM, in place) of
  // this tensor on this group, each call timed alone (microseconds), in one of two ways:
  // libddp's own ddp_allreduce, the call ddp-bench makes; or (c10d) the group's
  // ProcessGroup::allreduce and Work::wait from C++, the call DDP's reducer makes, which is
  // the plugin's whole path without PyTorch's Python wrapper and bindings. It lets the
  // benchmark time both in the same job, on the same memory and interleaved with the
  // torch.distributed calls, instead of in another process at another moment.
  m.def(
      "_bench_allreduce",
      [](const c10::intrusive_ptr<ProcessGroupLibddp> &pg, const at::Tensor &t, int64_t iters,
         bool c10d) {
        TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat,
                    "libddp_torch._C._bench_allreduce: takes a contiguous float32 CPU tensor");
        TORCH_CHECK(iters >= 0, "libddp_torch._C._bench_allreduce: ", iters, " iterations");
        std::vector<double> us(static_cast<size_t>(iters));
        void *p = t.data_ptr();
        size_t n = static_cast<size_t>(t.numel());
        std::vector<at::Tensor> list{t};
        py::gil_scoped_release nogil;
        for (auto &u : us) {
          auto t0 = std::chrono::steady_clock::now();
          if (c10d) {
            pg->allreduce(list, c10d::AllreduceOptions())->wait();
          } else {
            ddp_status_t st = ddp_allreduce(pg->pg(), p, p, n, DDP_F32, DDP_OP_SUM, nullptr);
            TORCH_CHECK(st == DDP_OK, "libddp_torch._C._bench_allreduce: ", ddp_status_name(st));
          }
          auto t1 = std::chrono::steady_clock::now();
          u = std::chrono::duration<double, std::micro>(t1 - t0).count();
        }
        return us;
      },
      py::arg("group"), py::arg("tensor"), py::arg("iters"), py::arg("c10d") = false);
}
