// pybind11 bindings of hp_kernels._C. Tensors cross as (address, size, dtype code) so the module
// never links against libtorch; every call that may take a while releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <string>
#include <memory>
#include <thread>

#include "common.h"

namespace py = pybind11;
using namespace hpk;

namespace {

// A copy (optionally followed by raising a flag) on a native thread, so that Python can run a
// matmul meanwhile. wait() joins it with the GIL released.
class AsyncCopy {
 public:
  AsyncCopy(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t flag, uint64_t flag_value)
      : thread_([=] {
          copy_bytes(dst, src, nbytes, 1);
          if (flag) {
            reinterpret_cast<std::atomic<uint64_t>*>(flag)->store(flag_value,
                                                                 std::memory_order_release);
            wake_all(flag);
          }
          done_.store(true, std::memory_order_release);
        }) {}
  ~AsyncCopy() {
    if (thread_.joinable()) thread_.join();
  }
  void wait() {
    py::gil_scoped_release release;
    if (thread_.joinable()) thread_.join();
  }
  bool done() const { return done_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// A mapped segment. Python's buffer protocol exposes it; torch.frombuffer keeps the memoryview
// and so this object alive, and the mapping goes when the last tensor viewing it does.
class Mapping {
 public:
  Mapping(uintptr_t addr, size_t size) : addr_(addr), size_(size) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { shm_unmap(addr_, size_); }
  uintptr_t addr() const { return addr_; }
  size_t size() const { return size_; }

 private:
  uintptr_t addr_;
  size_t size_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hp_kernels compiled core: shared memory, flags, copies, reductions, MoE sorting";
  m.attr("HAS_CUDA") = py::bool_(HP_KERNELS_HAS_CUDA != 0);
  // read HP_KERNELS_STREAM_MIN now, with the GIL held (getenv must not race os.environ)
  m.attr("STREAM_MIN_BYTES") = py::int_(stream_min_bytes());

  // Shared memory
  py::class_<Mapping, std::shared_ptr<Mapping>>(m, "Mapping", py::buffer_protocol())
      .def_buffer([](Mapping& mp) {
        return py::buffer_info(reinterpret_cast<void*>(mp.addr()), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(mp.size())}, {1}, false);
      })
      .def_property_readonly("addr", &Mapping::addr)
      .def_property_readonly("size", &Mapping::size);
  m.def("shm_create", [](const std::string& name, size_t nbytes) {
        return std::make_shared<Mapping>(shm_create(name, nbytes), nbytes);
      }, py::arg("name"), py::arg("nbytes"),
        "Create and map a POSIX shared-memory segment (fails if the name exists).");
  m.def("shm_attach", [](const std::string& name, size_t nbytes) {
        return std::make_shared<Mapping>(shm_attach(name, nbytes), nbytes);
      }, py::arg("name"), py::arg("nbytes"), "Map an existing segment.");
  m.def("shm_unlink", &shm_unlink_name, py::arg("name"),
        "Remove a segment's name (mappings stay valid); False if it was already gone.");
  m.def("pending_names", &pending_names, "Names created here and not yet unlinked.");
  m.def("memoryview", [](uintptr_t addr, size_t nbytes) {
        return py::memoryview::from_memory(reinterpret_cast<void*>(addr),
                                           static_cast<py::ssize_t>(nbytes), false);
      }, py::arg("addr"), py::arg("nbytes"), "A writable memoryview over raw memory.");

  // Flags
  m.def("store_u64", [](uintptr_t a, uint64_t v) {
        reinterpret_cast<std::atomic<uint64_t>*>(a)->store(v, std::memory_order_release);
        wake_all(a);
      }, "Store (release) and wake the waiters.");
  m.def("load_u64", [](uintptr_t a) {
        return reinterpret_cast<std::atomic<uint64_t>*>(a)->load(std::memory_order_acquire);
      });
  m.def("add_u64", [](uintptr_t a, uint64_t d) {
        uint64_t old = reinterpret_cast<std::atomic<uint64_t>*>(a)->fetch_add(
            d, std::memory_order_acq_rel);
        wake_all(a);
        return old;
      }, "Add (acq_rel), wake the waiters, return the old value.");
  m.def("wait_geq", &wait_geq, py::arg("addr"), py::arg("value"), py::arg("timeout_s"),
        py::arg("pid"), py::call_guard<py::gil_scoped_release>(),
        "Wait for *addr >= value: 0 reached, 1 timed out, 2 process pid is gone.");

  // Data
  m.def("copy", &copy_bytes, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        py::arg("nthreads") = 1, py::call_guard<py::gil_scoped_release>());
  m.def("cma_read", &cma_read, py::arg("pid"), py::arg("local"), py::arg("remote"),
        py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
        "Copy nbytes from process pid's address remote to local (process_vm_readv); 0 or errno.");
  m.def("strerror", [](int e) { return std::string(std::strerror(e)); });
  m.def("convert", &convert, py::arg("dst"), py::arg("dst_dtype"), py::arg("src"),
        py::arg("src_dtype"), py::arg("n"), py::arg("nthreads") = 1,
        py::call_guard<py::gil_scoped_release>());
  m.def("reduce", &reduce, py::arg("dst"), py::arg("dst_dtype"), py::arg("srcs"),
        py::arg("src_dtype"), py::arg("n"), py::arg("op"), py::arg("scale") = 1.0,
        py::arg("nthreads") = 1, py::call_guard<py::gil_scoped_release>());
  py::class_<AsyncCopy>(m, "AsyncCopy")
      .def(py::init<uintptr_t, uintptr_t, size_t, uintptr_t, uint64_t>(), py::arg("dst"),
           py::arg("src"), py::arg("nbytes"), py::arg("flag") = 0, py::arg("flag_value") = 0)
      .def("wait", &AsyncCopy::wait)
      .def("done", &AsyncCopy::done);

  // MoE
  m.def("expert_order", [](uintptr_t ids, size_t n, int64_t num_experts, uintptr_t order,
                           uintptr_t counts) {
        py::gil_scoped_release release;
        return expert_order(reinterpret_cast<const int64_t*>(ids), n, num_experts,
                            reinterpret_cast<int64_t*>(order), reinterpret_cast<int64_t*>(counts));
      }, py::arg("ids"), py::arg("n"), py::arg("num_experts"), py::arg("order"), py::arg("counts"));

#if HP_KERNELS_HAS_CUDA
  m.def("cuda_reduce", &cuda_reduce, py::arg("dst"), py::arg("dst_dtype"), py::arg("srcs"),
        py::arg("src_dtype"), py::arg("n"), py::arg("op"), py::arg("scale"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cuda_copy", &cuda_copy, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        py::arg("blocks"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  m.def("cuda_device_count", &cuda_device_count);
#endif
}
