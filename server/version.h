// The build's version: the release (VERSION, the chart's appVersion) with `git describe --always
// --dirty --tags` of the source tree when it was built as build metadata
// (cmake/write_version.cmake; -DDSA_VERSION=... overrides it, e.g. for an image's release build).
#pragma once

namespace dsa {

/// The version string baked in at build time, e.g. "0.1.0+a81c4f4-dirty"; the release alone when
/// the tree was not a git checkout and no override was given. Never null.
const char* BuildVersion();

/// The release this build is of: VERSION's MAJOR.MINOR.PATCH (the Helm chart's appVersion).
const char* ReleaseVersion();

}  // namespace dsa
