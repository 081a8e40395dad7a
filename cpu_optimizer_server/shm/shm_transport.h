// The shared-memory data plane: a trainer and a shard on the same host exchange one range's step
// through a segment the shard creates, at memcpy speed (ARCHITECTURE.md sections 4 and 9).
//
// Set-up, over the gRPC Attach stream of one (job, range): the shard creates a POSIX segment
// (shm_open) sized for the range, writes a random secret into it and offers its name; the trainer
// maps it and answers with the secret, which only a process sharing the shard's /dev/shm (same
// host, or two pods sharing a memory-backed emptyDir at /dev/shm) can read; the shard then
// unlinks the name, so the memory goes away with the last mapping and no stale segment can
// outlive a crash. An AttachOpen with an empty job_id is a probe: proof only, no range.
//
// Layout (one segment per attachment; little-endian, 64-byte aligned parts):
//   header: magic "OFSM", version, range offset and length, the secret, and the control words
//     (futex-backed 32-bit sequence counters) of a command ring written by the trainer and read by
//     the shard, the reply of the last command, and the count of parameters published;
//   gradients: (range length,) in the job's 16-bit dtype, at their range-relative position: the
//     trainer copies a step's gradients there, or writes them there in the first place
//     (StepStream::GradientArea: zero-copy), and the shard's Adam pass reads them in place
//     (StepSession::AddGradientsView), no copy on the shard;
//   parameters: (range length,) 16-bit: the shard's Adam pass writes each wave there (its
//     ParamSink buffer is the segment) and publishes how far it got; the trainer copies each
//     wave out as it lands (Commit), or reads it where it is (CommitInPlace: zero-copy);
//   chunk slots: a few fixed-size slots for what cannot be zero-copy (fp32 gradients, and
//     accumulate chunks, which must not overwrite the first micro-batch's gradients in place).
//
// Death of a peer: the shard serves the segment on the Attach handler thread and checks the gRPC
// context between waits; the trainer watches the Attach stream on a thread of its own. Either
// side's wait on the segment gives up within ShmOptions::poll_interval of the other's stream
// breaking, with UNAVAILABLE naming the shard.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_TRANSPORT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_TRANSPORT_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shm/shm_segment.h"
#include "cpu_optimizer_server/transport/step_transport.h"

namespace offload {

// The trainer's half (the shard's is shm_server.h). `control` (not owned) must outlive the
// transport. Attachments are made per (job, range) on first use and kept across steps.
absl::StatusOr<std::unique_ptr<StepTransport>> CreateShmTransport(ShardClient* control,
                                                                  const ShmOptions& options = {});

// Proves, with a probe attachment, that the shard behind `control` shares this process's shared
// memory. OK, or the reason it does not (FailedPrecondition: another host; Unimplemented: the
// server offers no shared memory).
absl::Status ProbeShm(ShardClient* control);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_TRANSPORT_H_
