// A worker's table of coordinator leases (contracts/lease.h): which lease holds each sequence,
// when each lease runs out, and which instances of an owner are superseded. The services' adapters
// keep one beside their OwnerTable and release, through their engine, what it hands back
// (docs/reliability.md, "Ownership that survives its owner"). The pattern is Kubernetes' Lease and
// etcd's: time to live, renewal, and the holder's identity.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "contracts/lease.h"

namespace dsa {

/// Leases by owner, and the lease of each leased sequence, on an injected clock. Thread-safe.
///
/// An owner has at most one live lease, under its latest instance. A lease is live from a renewal
/// (Renew, or Attach of a sequence) until `ttl` after the last one; then TakeExpired hands its
/// sequences back for release and the lease ends (a later renewal starts a new one, `renewed`
/// false, so the coordinator learns that what it held here is gone). A renewal or attach under
/// another instance of the owner ends the live lease at once (that coordinator restarted) and hands
/// its sequences back; the earlier instance is superseded, refused from then on (the last
/// kSupersededKept of an owner are remembered), so a coordinator that was only paused cannot take
/// its workers back from its successor. An owner belongs to the first caller identity that used it
/// (a TLS or token identity; "" on plaintext, where any caller is the same).
class SequenceLeases {
 public:
  /// Superseded instances remembered per owner.
  static constexpr int kSupersededKept = 16;
  /// Longest owner name or instance id accepted, in bytes.
  static constexpr size_t kMaxNameBytes = kMaxLeaseNameBytes;
  /// Owners remembered at most; a new owner past it evicts one without a live lease (its
  /// superseded instances forgotten), or is refused when every one has a live lease.
  static constexpr size_t kMaxOwners = 4096;

  /// What a renewal found, and the sequences the caller must now release (their lease ended: it
  /// expired before this renewal came, or it was an earlier instance's).
  struct Renewal {
    bool renewed = false;            // the lease was live under this instance
    int64_t sequences = 0;           // sequences the lease holds after the call
    int64_t superseded = 0;          // of `released`, those of the owner's earlier instances
    std::vector<uint64_t> released;  // to release now, in no particular order
  };

  /// `clock` is not owned and must outlive the table.
  explicit SequenceLeases(const Clock* clock);

  /// Whether `lease` could be renewed by `caller` now, changing nothing (before a create, so that
  /// a refused lease creates nothing). OK for an empty lease. Errors: INVALID_ARGUMENT (no
  /// instance id, a name over kMaxNameBytes, ttl outside (0, kMaxLeaseTtl]), FAILED_PRECONDITION
  /// (a superseded instance), PERMISSION_DENIED (the owner is another caller's).
  absl::Status Check(const SequenceLease& lease, const std::string& caller) const;

  /// Renews `lease` (not empty) for `caller`: it runs until now + ttl. Errors as Check, and
  /// RESOURCE_EXHAUSTED for a new owner when kMaxOwners owners have live leases.
  absl::StatusOr<Renewal> Renew(const SequenceLease& lease, const std::string& caller);

  /// Puts sequence `id` under `lease`, renewing it, and takes it out of any other lease; an empty
  /// lease only takes it out (held until released). Errors as Check, and then nothing changed.
  absl::StatusOr<Renewal> Attach(uint64_t id, const SequenceLease& lease,
                                 const std::string& caller);

  /// Takes `id` out of its lease (it was released). Nothing for a sequence under none.
  void Detach(uint64_t id);

  /// Ends every lease not renewed for its ttl by now and returns their sequences, to release.
  std::vector<uint64_t> TakeExpired();

  /// Live leases, and the sequences they hold.
  int64_t live_leases() const;
  int64_t leased_sequences() const;

 private:
  struct Owner {
    std::string caller;       // bound at first use
    bool live = false;        // a lease runs under `instance_id`
    std::string instance_id;  // the latest instance
    absl::Time expires;
    absl::flat_hash_set<uint64_t> sequences;
    std::deque<std::string> superseded;  // oldest first, at most kSupersededKept
  };

  absl::Status CheckLocked(const SequenceLease& lease, const std::string& caller) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Ends `owner`'s live lease, moving its sequences to `released`.
  void EndLocked(Owner& owner, std::vector<uint64_t>& released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Renewal> RenewLocked(const SequenceLease& lease, const std::string& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* const clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Owner> owners_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::string> owner_of_ ABSL_GUARDED_BY(mu_);  // sequence -> owner
};

}  // namespace dsa
