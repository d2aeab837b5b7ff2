// Shared declarations of the hp_kernels compiled module. Everything here works on raw
// addresses and sizes: no torch headers, no libtorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hpk {

// Element types, numbered as hp_kernels._dtypes numbers them.
enum DType : int { F32 = 0, BF16 = 1, F16 = 2, F64 = 3, I64 = 4, I32 = 5 };
enum ReduceOp : int { SUM = 0, AVG = 1, MAX = 2 };

size_t dtype_size(int dtype);

// ---- POSIX shared memory (shm.cpp) ----
uintptr_t shm_create(const std::string& name, size_t nbytes);  // O_EXCL; remembered for clean-up
uintptr_t shm_attach(const std::string& name, size_t nbytes);
bool shm_unlink_name(const std::string& name);                 // false if it was already gone
void shm_unmap(uintptr_t addr, size_t nbytes);
void install_cleanup_handlers();
std::vector<std::string> pending_names();

// ---- flags (ops.cpp) ----
// Wait until *addr >= value. Returns 0 when reached, 1 on timeout, 2 when the process `pid`
// is gone (checked every ~50 ms; pid <= 0 skips the check).
int wait_geq(uintptr_t addr, uint64_t value, double timeout_s, int64_t pid);
// Wake every process sleeping in wait_geq on addr (call after raising the counter).
void wake_all(uintptr_t addr);

// ---- data movement (ops.cpp) ----
// One copy from process pid's memory at remote into local; 0 or an errno.
int cma_read(int64_t pid, uintptr_t local, uintptr_t remote, size_t nbytes);
// Copies of at least stream_min_bytes() store past the caches (x86-64); overlapping ranges
// are copied as by memmove.
void copy_bytes(uintptr_t dst, uintptr_t src, size_t nbytes, int nthreads);
size_t stream_min_bytes();
void convert(uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, size_t n, int nthreads);
// dst[i] = op_k srcs[k][i], accumulated in float32 (float64 for F64, int64 for integers).
void reduce(uintptr_t dst, int dst_dtype, const std::vector<uintptr_t>& srcs, int src_dtype,
            size_t n, int op, double scale, int nthreads);

// ---- MoE (ops.cpp) ----
// Stable counting sort of flattened expert ids: order[j] = flat index of the j-th row of the
// permuted layout; counts[e] = rows routed to expert e. Returns the first bad id's position or -1.
int64_t expert_order(const int64_t* ids, size_t n, int64_t num_experts, int64_t* order,
                     int64_t* counts);

#if HP_KERNELS_HAS_CUDA
// ---- CUDA (cuda_ops.cu) ----
// Same contract as reduce(), on device pointers (peer pointers of one host work over NVLink),
// enqueued on `stream`; returns a CUDA error string, empty on success.
std::string cuda_reduce(uintptr_t dst, int dst_dtype, const std::vector<uintptr_t>& srcs,
                        int src_dtype, size_t n, int op, double scale, uintptr_t stream);
// Copy with SM loads/stores of 16 bytes (a peer's memory over NVLink), on `blocks` CTAs at most.
std::string cuda_copy(uintptr_t dst, uintptr_t src, size_t nbytes, int blocks, uintptr_t stream);
int cuda_device_count();
#endif

}  // namespace hpk
