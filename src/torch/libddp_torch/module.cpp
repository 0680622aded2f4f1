// The Python module libddp_torch._C: the group class and its factory; libddp_torch/__init__.py
// registers the factory with torch.distributed (docs/torch.md).
#include <torch/csrc/utils/pybind.h>

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
         bool flight_recorder) {
        Config cfg;
        cfg.flight_recorder = flight_recorder;
        cfg.transport = transport;
        cfg.transport_source = source;
        cfg.algorithm = algorithm;
        return c10::make_intrusive<ProcessGroupLibddp>(
            store, rank, size, std::chrono::milliseconds(timeout_ms), cfg);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"),
      py::arg("transport"), py::arg("source"), py::arg("algorithm"),
      py::arg("flight_recorder") = true,
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
}
