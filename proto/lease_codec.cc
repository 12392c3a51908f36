#include "proto/lease_codec.h"

namespace dsa {

SequenceLease DecodeLease(const dsa::common::v1::Lease& lease) {
  SequenceLease out;
  out.owner = lease.owner();
  out.instance_id = lease.instance_id();
  out.ttl = absl::Milliseconds(lease.ttl_ms());
  return out;
}

void EncodeLease(const SequenceLease& lease, dsa::common::v1::Lease* out) {
  out->Clear();
  if (lease.empty()) return;
  out->set_owner(lease.owner);
  out->set_instance_id(lease.instance_id);
  out->set_ttl_ms(absl::ToInt64Milliseconds(lease.ttl));
}

}  // namespace dsa
