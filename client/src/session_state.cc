// ClientSession's state transfer (dos_state_read / dos_state_write and
// their ranged forms): pieces of at most kStateTransferChunk elements
// through one shared-memory buffer, by ExportState / ImportState RPCs.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "dos/wire/status_macros.h"
#include "session.h"

namespace dos::client {

absl::Status ClientSession::CheckTensor(uint32_t tensor, const char* call) const {
  if (!registered_) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": no tensors registered; call dos_register first"));
  }
  if (tensor >= tensors_.size()) {
    return absl::OutOfRangeError(absl::StrCat(call, ": tensor ", tensor, " out of range; ",
                                              tensors_.size(), " tensors are registered"));
  }
  if (step_.in_flight()) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": a step is in flight; call dos_step_wait first"));
  }
  return absl::OkStatus();
}

absl::Status ClientSession::ReadState(uint32_t tensor, float* master, float* exp_avg,
                                      float* exp_avg_sq, int64_t* step) {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, "state_read"));
  return ReadStateRange(tensor, 0, tensors_[tensor].numel, master, exp_avg, exp_avg_sq, step);
}

absl::Status ClientSession::WriteState(uint32_t tensor, const float* master, const float* exp_avg,
                                       const float* exp_avg_sq, int64_t step) {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, "state_write"));
  return WriteStateRange(tensor, 0, tensors_[tensor].numel, master, exp_avg, exp_avg_sq, step);
}

absl::Status ClientSession::CheckRange(uint32_t tensor, uint64_t offset, uint64_t count,
                                       const char* call) const {
  DOS_RETURN_IF_ERROR(CheckTensor(tensor, call));
  const uint64_t n = tensors_[tensor].numel;
  if (offset > n || count > n - offset) {
    return absl::OutOfRangeError(absl::StrCat(call, ": elements [", offset, ", ", offset + count,
                                              ") of tensor ", tensor, " are out of range; it has ",
                                              n, " elements"));
  }
  return absl::OkStatus();
}

absl::Status ClientSession::TransferPiece(bool import, uint32_t tensor, uint64_t offset,
                                          uint64_t count, const ShmSegment& seg, int64_t step,
                                          int64_t* step_out) {
  v1::TransferStateRequest req;
  *req.mutable_session() = ref_;
  req.set_tensor(tensor);
  DOS_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, SendSegments({&seg}));
  req.mutable_buffer()->set_segment(ids[0]);
  req.mutable_buffer()->set_offset(0);
  // The whole tensor goes as count 0, which daemons without ranged
  // transfers understand too.
  if (offset != 0 || count != tensors_[tensor].numel) {
    req.set_offset(offset);
    req.set_count(count);
  }
  if (import) req.set_step(step);
  v1::TransferStateResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  grpc::Status rpc = import ? stub_->ImportState(&ctx, req, &resp)
                            : stub_->ExportState(&ctx, req, &resp);
  if (!rpc.ok()) return FromRpc(import ? "state_write" : "state_read", rpc);
  if (step_out != nullptr) *step_out = resp.step();
  return absl::OkStatus();
}

absl::Status ClientSession::ReadStateRange(uint32_t tensor, uint64_t offset, uint64_t count,
                                           float* master, float* exp_avg, float* exp_avg_sq,
                                           int64_t* step) {
  DOS_RETURN_IF_ERROR(CheckRange(tensor, offset, count, "state_read"));
  if (count == 0 || (master == nullptr && exp_avg == nullptr && exp_avg_sq == nullptr)) {
    // Nothing to copy; the step is read with one element.
    if (step == nullptr || tensors_[tensor].numel == 0) return absl::OkStatus();
    DOS_ASSIGN_OR_RETURN(auto seg, CreateSegment(12, /*transfer=*/true));
    return TransferPiece(false, tensor, 0, 1, *seg, 0, step);
  }
  const uint64_t piece = std::min(count, kStateTransferChunk);
  DOS_ASSIGN_OR_RETURN(auto seg, CreateSegment(12 * piece, /*transfer=*/true));
  const float* base = static_cast<const float*>(seg->data());
  for (uint64_t done = 0; done < count;) {
    const uint64_t k = std::min(piece, count - done);
    DOS_RETURN_IF_ERROR(TransferPiece(false, tensor, offset + done, k, *seg, 0, step));
    if (master != nullptr) std::memcpy(master + done, base, 4 * k);
    if (exp_avg != nullptr) std::memcpy(exp_avg + done, base + k, 4 * k);
    if (exp_avg_sq != nullptr) std::memcpy(exp_avg_sq + done, base + 2 * k, 4 * k);
    done += k;
  }
  return absl::OkStatus();
}

absl::Status ClientSession::WriteStateRange(uint32_t tensor, uint64_t offset, uint64_t count,
                                            const float* master, const float* exp_avg,
                                            const float* exp_avg_sq, int64_t step) {
  DOS_RETURN_IF_ERROR(CheckRange(tensor, offset, count, "state_write"));
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("state_write: step = ", step, "; must be >= 0"));
  }
  if (count == 0) return absl::OkStatus();
  const uint64_t piece = std::min(count, kStateTransferChunk);
  DOS_ASSIGN_OR_RETURN(auto seg, CreateSegment(12 * piece, /*transfer=*/true));
  float* base = static_cast<float*>(seg->data());
  const bool partial = master == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr;
  uint64_t done = 0;
  while (done < count) {
    const uint64_t k = std::min(piece, count - done);
    if (partial) {  // start from the daemon's current state
      DOS_RETURN_IF_ERROR(TransferPiece(false, tensor, offset + done, k, *seg, 0, nullptr));
    }
    if (master != nullptr) std::memcpy(base, master + done, 4 * k);
    if (exp_avg != nullptr) std::memcpy(base + k, exp_avg + done, 4 * k);
    if (exp_avg_sq != nullptr) std::memcpy(base + 2 * k, exp_avg_sq + done, 4 * k);
    DOS_RETURN_IF_ERROR(TransferPiece(true, tensor, offset + done, k, *seg, step, nullptr));
    done += k;
  }
  return absl::OkStatus();
}

}  // namespace dos::client
