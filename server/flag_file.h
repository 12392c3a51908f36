// The servers' --config file read by a TOML parser (toml++), and the suggestions for a misspelt
// flag (docs/deploy.md, "Flags every server takes").
#pragma once

#include <istream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"

namespace dsa {

/// The closest long flag names of `app` to `name` (without its leading dashes; '_' read as '-'):
/// those within an edit distance of max(2, |name| / 3), nearest first, at most 3. Empty when none
/// is close. --help, --version and --config are never suggested.
std::vector<std::string> SuggestFlags(const CLI::App& app, const std::string& name);

/// CLI11's config reader for a TOML file of flags: one `name = value` a flag (strings, integers,
/// floats, booleans, and arrays of them for list flags), names with '-' or '_' alike
/// (`capacity_blocks` is --capacity-blocks). Refused with CLI::ConfigError, naming the file, line
/// and column: TOML that does not parse (toml++'s description), a table or an array of tables
/// (the file holds flags only), a date or time, a nested array, and a name that is no flag of
/// `app` ("did you mean ..." from SuggestFlags). Values are checked by the flags' own
/// validators afterwards, as on the command line.
class TomlFlagFile final : public CLI::Config {
 public:
  /// `app` must outlive this reader (AddFlagSources installs it on the app itself).
  explicit TomlFlagFile(const CLI::App* app) : app_(app) {}

  std::string to_config(const CLI::App* app, bool default_also, bool write_description,
                        std::string prefix) const override;
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override;

 private:
  const CLI::App* app_;
};

/// CLI11's parse of `argv` for a server's main: on an error prints it, with "did you mean --X?"
/// for a misspelt flag, and returns the exit code to end with; -1 when it parsed. (CLI11_PARSE
/// without suggestions.)
int ParseServerFlags(CLI::App& app, int argc, char** argv);

}  // namespace dsa
