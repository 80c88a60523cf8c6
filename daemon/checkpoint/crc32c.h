// CRC32C (Castagnoli, the iSCSI / ext4 / LevelDB polynomial) over byte spans.
//
// Debian 12's abseil (20220623) has no absl/crc, so the checkpoint format
// carries its own: the SSE4.2 crc32 instruction where the CPU has it (chosen
// at run time; the shipped build has no -march=native) and a slicing-by-8
// table otherwise. Both give identical results; the tests check them against
// each other and against the RFC 3720 test vectors.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dos::crc32c {

// Returns the CRC32C of data[0, n) appended to a stream whose CRC so far was
// `crc` (0 for an empty stream): Extend(Extend(0, a), b) == Value(a + b).
uint32_t Extend(uint32_t crc, const void* data, size_t n);
inline uint32_t Value(const void* data, size_t n) { return Extend(0, data, n); }

// The portable table implementation, exposed so tests can compare it with
// the hardware path.
uint32_t ExtendPortable(uint32_t crc, const void* data, size_t n);
// True when Extend uses the SSE4.2 instruction on this CPU.
bool HardwareAccelerated();

}  // namespace dos::crc32c
