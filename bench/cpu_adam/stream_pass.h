// The benchmark's host-memory yardsticks: STREAM-like passes with (almost) no
// arithmetic, shaped as Adam kernels (AdamKernelFn) so that CpuUpdater runs
// them over exactly the tiles, threads, partition and pinning the kernel
// gets (CpuUpdater::RunKernel). Spans carry a bf16 gradient and a bf16
// weight out.
//   adam:      reads the bf16 gradient and fp32 p, m, v, writes p, m, v back
//              plus a bf16 weight: 4 streams read, 4 written, 28 bytes, exactly
//              what the kernel moves for bf16 gradients and bf16 weights;
//              ordinary stores, or non-temporal ones for the weight only
//              ("ntout") or for everything written ("ntall"), as the kernel's
//              Stores choice does.
//   read:      reads the bf16 gradient and p, m, v (14 bytes), writes nothing
//              (one 64-byte line per tile).
//   triad:     p = m + s * v (STREAM triad): 8 bytes read, 4 written, counted
//              as 12 as STREAM does (the read-for-ownership of p is extra).
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "daemon/cpu/adam_kernel.h"

namespace dos::bench {

struct Yardstick {
  std::string_view name;  // "adam", "adam_ntout", "adam_ntall", "read", "triad"
  cpu::AdamKernelFn fn;
  size_t bytes_per_element;  // bytes counted per element
};

// The yardsticks this CPU runs (AVX-512, else AVX2, else scalar code).
std::vector<Yardstick> Yardsticks();

namespace internal {
void AdamPassAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s);
void AdamPassNtOutAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s);
void AdamPassNtAllAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s);
void ReadPassAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s);
void TriadPassAvx512(const cpu::AdamScalars&, const cpu::AdamSpan& s);
void AdamPassAvx2(const cpu::AdamScalars&, const cpu::AdamSpan& s);
void ReadPassAvx2(const cpu::AdamScalars&, const cpu::AdamSpan& s);
void TriadPassAvx2(const cpu::AdamScalars&, const cpu::AdamSpan& s);
}  // namespace internal

}  // namespace dos::bench
