// The build's version: `git describe --always --dirty --tags` of the source tree when it was built
// (cmake/write_version.cmake; -DDSA_VERSION=... overrides it, e.g. for an image built without
// .git).
#pragma once

namespace dsa {

/// The version string baked in at build time, e.g. "a81c4f4-dirty" or "v0.1.0-3-g1b7d485";
/// "unknown" when the tree was not a git checkout and no override was given. Never null.
const char* BuildVersion();

}  // namespace dsa
