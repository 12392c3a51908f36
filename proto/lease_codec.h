// The wire form of a coordinator's lease (dsa.common.v1.Lease) and its plain form
// (contracts/lease.h). The values are checked where the lease is used (server/sequence_leases.h).
#pragma once

#include "contracts/lease.h"
#include "dsa/common/v1/lease.pb.h"

namespace dsa {

/// `lease` in plain form; an unset lease gives an empty one (no lease).
SequenceLease DecodeLease(const dsa::common::v1::Lease& lease);

/// `lease` in wire form (ttl in whole milliseconds, rounded down); an empty lease clears `out`.
void EncodeLease(const SequenceLease& lease, dsa::common::v1::Lease* out);

}  // namespace dsa
