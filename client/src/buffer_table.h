// BufferTable: which client-allocated shared-memory buffer a user pointer
// lies in.
//
// The client allocates every parameter and gradient buffer itself
// (dos_buffer_alloc); the daemon only understands (shm name, byte offset)
// pairs. BufferTable records each buffer's name, base address and size, and
// resolves a pointer plus a byte count to the buffer that fully contains it.
// It owns no memory; ClientSession owns the mappings and keeps the table in
// step with them.
//
// Thread-safety: none; owned by one ClientSession, used by one thread at a
// time.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dos::client {

struct BufferRef {
  std::string name;  // shm object name, e.g. "/dos.812.3.0"
  uint64_t offset;   // bytes from the start of the object
};

class BufferTable {
 public:
  // Records a buffer. Buffers must not overlap (mappings never do).
  void Add(std::string name, const void* base, uint64_t bytes);
  void Remove(std::string_view name);

  // Resolves [ptr, ptr + bytes) to the buffer containing it.
  // INVALID_ARGUMENT, naming `what` (e.g. "tensor 'fc1.weight' param"), when
  // ptr is null, lies in no buffer, or the range overruns its buffer.
  absl::StatusOr<BufferRef> Resolve(const void* ptr, uint64_t bytes, const std::string& what) const;
  // True when ptr lies inside a recorded buffer (whatever follows it).
  bool Contains(const void* ptr) const;

  size_t size() const { return buffers_.size(); }

 private:
  struct Entry {
    std::string name;
    uintptr_t base;
    uint64_t bytes;
  };
  std::vector<Entry> buffers_;  // sorted by base
};

}  // namespace dos::client
