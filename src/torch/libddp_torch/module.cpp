// The Python module libddp_torch._C: the group class and its factory; libddp_torch/__init__.py
// registers the factory with torch.distributed (docs/torch.md).
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <vector>

#include "process_group.hpp"

namespace py = pybind11;
using libddp_torch::Config;
using libddp_torch::ProcessGroupLibddp;

PYBIND11_MODULE(_C, m) {
  // c10d's ProcessGroup and Store classes are registered by torch.distributed.
  py::module::import("torch.distributed");
  py::class_<ProcessGroupLibddp, c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupLibddp>>(
      m, "ProcessGroupLibddp")
      .def_property_readonly("transport", &ProcessGroupLibddp::transport,
                             "The libddp transport this group runs on: shm, tcp or mpi.");
  m.def(
      "create",
      [](const c10::intrusive_ptr<c10d::Store> &store, int rank, int size, int64_t timeout_ms,
         const std::string &transport, const std::string &source, const std::string &algorithm,
         bool flight_recorder, bool defer_start) {
        Config cfg;
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
      py::call_guard<py::gil_scoped_release>());
  // A tensor of nbytes bytes in the group's communication memory (ddp_pg_alloc: on shm the
  // shared segment, which peers read in place, so a collective on it skips the staging
  // copies). The storage keeps the group alive and goes back to it when the tensor dies.
  m.def(
      "alloc",
      [](const c10::intrusive_ptr<ProcessGroupLibddp> &pg, int64_t nbytes) {
        TORCH_CHECK(nbytes >= 0, "libddp_torch.empty: ", nbytes, " bytes");
        void *p = ddp_pg_alloc(pg->pg(), static_cast<size_t>(nbytes));
        if (!p) {
          ddp_error_t e = {};
          ddp_pg_last_error_copy(pg->pg(), &e);
          TORCH_CHECK(false, "libddp_torch.empty: ", e.msg[0] ? e.msg : "out of memory");
        }
        c10::intrusive_ptr<ProcessGroupLibddp> keep = pg;
        return at::from_blob(
            p, {nbytes}, [keep](void *q) { ddp_pg_free(keep->pg(), q); },
            at::TensorOptions().dtype(at::kByte));
      },
      py::arg("group"), py::arg("nbytes"));
  // For tools/bench/bench_torch.py: times `iters` blocking ddp_allreduce calls (SUM, in
  // place) on this group and tensor, the call ddp-bench makes, each call timed alone
  // (microseconds). It lets the benchmark time libddp's own path in the same job, on the
  // same memory and interleaved with the torch.distributed calls, instead of in another
  // process at another moment.
  m.def(
      "_bench_allreduce",
      [](const c10::intrusive_ptr<ProcessGroupLibddp> &pg, const at::Tensor &t, int64_t iters) {
        TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat,
                    "libddp_torch._C._bench_allreduce: takes a contiguous float32 CPU tensor");
        TORCH_CHECK(iters >= 0, "libddp_torch._C._bench_allreduce: ", iters, " iterations");
        std::vector<double> us(static_cast<size_t>(iters));
        void *p = t.data_ptr();
        size_t n = static_cast<size_t>(t.numel());
        py::gil_scoped_release nogil;
        for (auto &u : us) {
          auto t0 = std::chrono::steady_clock::now();
          ddp_status_t st = ddp_allreduce(pg->pg(), p, p, n, DDP_F32, DDP_OP_SUM, nullptr);
          auto t1 = std::chrono::steady_clock::now();
          TORCH_CHECK(st == DDP_OK, "libddp_torch._C._bench_allreduce: ", ddp_status_name(st));
          u = std::chrono::duration<double, std::micro>(t1 - t0).count();
        }
        return us;
      },
      py::arg("group"), py::arg("tensor"), py::arg("iters"));
}
