// Who holds a worker's sequences, and for how long without a word from them: a coordinator's lease
// (docs/reliability.md, "Ownership that survives its owner"). The plain form of
// dsa.common.v1.Lease that the coordinator, the attention worker and the indexer share.
#pragma once

#include <cstddef>
#include <string>

#include "absl/time/time.h"

namespace dsa {

/// A coordinator's lease on the sequences it creates on a worker. A worker releases every sequence
/// of a lease that was not renewed for `ttl`; a renewal (or a create) under a new instance of the
/// same owner releases at once what the earlier instances held (that coordinator restarted), and a
/// superseded instance is refused from then on. An empty owner means no lease: the sequence is held
/// until it is released.
struct SequenceLease {
  /// The coordinator's name, the same across its restarts (dsa-coordinator --name).
  std::string owner;
  /// Random per coordinator start (common/instance_id.h).
  std::string instance_id;
  /// How long the worker holds the owner's sequences without a renewal, in (0, kMaxLeaseTtl].
  absl::Duration ttl = absl::ZeroDuration();

  bool empty() const { return owner.empty(); }
};

/// The longest lease a worker grants: a lost coordinator's sequences come back within this.
inline constexpr absl::Duration kMaxLeaseTtl = absl::Minutes(10);

/// The longest owner name or instance id a worker accepts, in bytes.
inline constexpr size_t kMaxLeaseNameBytes = 256;

/// How often a worker releases the sequences of expired leases: a lease's sequences are released
/// at most this long after its ttl ran out.
inline constexpr absl::Duration kLeaseSweepPeriod = absl::Milliseconds(250);

}  // namespace dsa
