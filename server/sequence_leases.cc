#include "server/sequence_leases.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dsa {

SequenceLeases::SequenceLeases(const Clock* clock) : clock_(clock) {}

absl::Status SequenceLeases::CheckLocked(const SequenceLease& lease,
                                         const std::string& caller) const {
  if (lease.empty()) return absl::OkStatus();
  if (lease.owner.size() > kMaxNameBytes || lease.instance_id.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease owner and instance_id must be at most ", kMaxNameBytes, " bytes each"));
  }
  if (lease.instance_id.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease of owner ", lease.owner, " has no instance_id"));
  }
  if (lease.ttl <= absl::ZeroDuration() || lease.ttl > kMaxLeaseTtl) {
    return absl::InvalidArgumentError(absl::StrCat("lease ttl ", absl::FormatDuration(lease.ttl),
                                                   " is outside (0, ",
                                                   absl::FormatDuration(kMaxLeaseTtl), "]"));
  }
  const auto it = owners_.find(lease.owner);
  if (it == owners_.end()) return absl::OkStatus();
  const Owner& owner = it->second;
  if (owner.caller != caller) {
    return absl::PermissionDeniedError(
        absl::StrCat("lease owner ", lease.owner, " belongs to another caller"));
  }
  if (std::find(owner.superseded.begin(), owner.superseded.end(), lease.instance_id) !=
      owner.superseded.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("instance ", lease.instance_id, " of lease owner ", lease.owner,
                     " was superseded by instance ", owner.instance_id,
                     " (that owner restarted); its sequences here were released"));
  }
  return absl::OkStatus();
}

absl::Status SequenceLeases::Check(const SequenceLease& lease, const std::string& caller) const {
  absl::ReaderMutexLock lock(&mu_);
  return CheckLocked(lease, caller);
}

void SequenceLeases::EndLocked(Owner& owner, std::vector<uint64_t>& released) {
  for (const uint64_t id : owner.sequences) {
    owner_of_.erase(id);
    released.push_back(id);
  }
  owner.sequences.clear();
  owner.live = false;
}

absl::StatusOr<SequenceLeases::Renewal> SequenceLeases::RenewLocked(const SequenceLease& lease,
                                                                    const std::string& caller) {
  if (absl::Status checked = CheckLocked(lease, caller); !checked.ok()) return checked;
  auto it = owners_.find(lease.owner);
  if (it == owners_.end()) {
    if (owners_.size() >= kMaxOwners) {
      auto idle = std::find_if(owners_.begin(), owners_.end(),
                               [](const auto& entry) { return !entry.second.live; });
      if (idle == owners_.end()) {
        return absl::ResourceExhaustedError(
            absl::StrCat("this worker holds the leases of ", kMaxOwners, " owners"));
      }
      owners_.erase(idle);
    }
    it = owners_.emplace(lease.owner, Owner{}).first;
    it->second.caller = caller;
  }
  Owner& owner = it->second;
  const absl::Time now = clock_->Now();
  Renewal renewal;
  if (owner.live && owner.instance_id != lease.instance_id) {
    EndLocked(owner, renewal.released);
    renewal.superseded = static_cast<int64_t>(renewal.released.size());
    owner.superseded.push_back(owner.instance_id);
    if (owner.superseded.size() > static_cast<size_t>(kSupersededKept)) {
      owner.superseded.pop_front();
    }
  } else if (owner.live && now >= owner.expires) {
    EndLocked(owner, renewal.released);  // a renewal that came too late does not revive it
  }
  renewal.renewed = owner.live;
  owner.live = true;
  owner.instance_id = lease.instance_id;
  owner.expires = now + lease.ttl;
  renewal.sequences = static_cast<int64_t>(owner.sequences.size());
  return renewal;
}

absl::StatusOr<SequenceLeases::Renewal> SequenceLeases::Renew(const SequenceLease& lease,
                                                              const std::string& caller) {
  if (lease.empty()) return absl::InvalidArgumentError("lease has no owner");
  absl::MutexLock lock(&mu_);
  return RenewLocked(lease, caller);
}

absl::StatusOr<SequenceLeases::Renewal> SequenceLeases::Attach(uint64_t id,
                                                               const SequenceLease& lease,
                                                               const std::string& caller) {
  absl::MutexLock lock(&mu_);
  Renewal renewal;
  if (!lease.empty()) {
    absl::StatusOr<Renewal> renewed = RenewLocked(lease, caller);
    if (!renewed.ok()) return renewed.status();
    renewal = *std::move(renewed);
  }
  // `id` itself may have been under the lease just ended: it stays (it is being created or
  // continued under the new one), so it is not released.
  renewal.released.erase(std::remove(renewal.released.begin(), renewal.released.end(), id),
                         renewal.released.end());
  if (const auto was = owner_of_.find(id); was != owner_of_.end()) {
    owners_[was->second].sequences.erase(id);
    owner_of_.erase(was);
  }
  if (!lease.empty()) {
    Owner& owner = owners_[lease.owner];
    owner.sequences.insert(id);
    owner_of_[id] = lease.owner;
    renewal.sequences = static_cast<int64_t>(owner.sequences.size());
  }
  return renewal;
}

void SequenceLeases::Detach(uint64_t id) {
  absl::MutexLock lock(&mu_);
  const auto it = owner_of_.find(id);
  if (it == owner_of_.end()) return;
  owners_[it->second].sequences.erase(id);
  owner_of_.erase(it);
}

std::vector<uint64_t> SequenceLeases::TakeExpired() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<uint64_t> released;
  for (auto& [name, owner] : owners_) {
    if (owner.live && now >= owner.expires) EndLocked(owner, released);
  }
  return released;
}

int64_t SequenceLeases::live_leases() const {
  absl::ReaderMutexLock lock(&mu_);
  return std::count_if(owners_.begin(), owners_.end(),
                       [](const auto& entry) { return entry.second.live; });
}

int64_t SequenceLeases::leased_sequences() const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int64_t>(owner_of_.size());
}

}  // namespace dsa
