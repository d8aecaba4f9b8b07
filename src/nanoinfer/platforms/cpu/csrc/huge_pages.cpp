// Zero-filled tensors whose memory Linux may back with 2 MiB pages (transparent huge pages asked for with
// madvise, which is what most distributions enable: "madvise" mode does nothing for plain malloc memory).
//
// Why: a decode step streams every packed weight once (270 MB for SmolLM2-135M in bfloat16); on 4 KiB pages
// that is ~66,000 pages a step, each a TLB miss; on 2 MiB pages the decode linears ran faster
// (benchmarks/README.md, design measurements).
//
// The memory is an anonymous mapping: zero until written and committed page by page as it is first written
// (a huge page at a time where the kernel grants one); the packed weights are written once, at load. The KV
// cache, written a block at a time all through a run, stays on 4 KiB pages (engine/model_runner.py says
// why). Small tensors, and other systems, get an ordinary torch::zeros.
#include "simd.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

torch::Tensor zeros_on_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = torch::TensorOptions().dtype(dtype);
  int64_t numel = 1;
  for (const int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "zeros_on_huge_pages: negative size");
    numel *= s;
  }
  const size_t bytes = (size_t)numel * c10::elementSize(dtype);
  constexpr size_t kHuge = size_t(2) << 20;
#ifdef __linux__
  if (bytes >= kHuge) {
    // One spare huge page so the tensor can start on a 2 MiB boundary (mmap aligns to 4 KiB only).
    const size_t length = bytes + kHuge;
    void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(uintptr_t)(kHuge - 1);
      // A refusal (THP off, an old kernel) leaves ordinary pages: the same memory, only slower to stream.
      madvise(reinterpret_cast<void*>(start), (bytes + kHuge - 1) & ~(kHuge - 1), MADV_HUGEPAGE);
      return torch::from_blob(
          reinterpret_cast<void*>(start), sizes, [base, length](void*) { munmap(base, length); }, options);
    }
  }
#endif
  return torch::zeros(sizes, options);
}
