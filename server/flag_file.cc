// The --config file through toml++ and flag suggestions (see flag_file.h).
#include "server/flag_file.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
// Header-only: the servers then need no libtomlplusplus at run time (the images stay as they are).
#define TOML_HEADER_ONLY 1
#include "toml++/toml.h"

namespace dsa {
namespace {

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string Hyphenated(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

// The --config file's path as given (command line or DSA_CONFIG), for messages.
std::string ConfigPath(const CLI::App* app) {
  const CLI::Option* config = app->get_config_ptr();
  if (config == nullptr) return "the --config file";
  if (config->count() > 0) return config->as<std::string>();
  const std::string fallback = config->get_default_str();
  return fallback.empty() ? "the --config file" : fallback;
}

std::string At(const CLI::App* app, const toml::source_region& where) {
  return absl::StrCat(ConfigPath(app), ":", where.begin.line, ":", where.begin.column);
}

// One scalar as the command line would spell it.
bool ScalarText(const toml::node& node, std::string* text) {
  if (const auto* s = node.as_string()) {
    *text = s->get();
  } else if (const auto* i = node.as_integer()) {
    *text = std::to_string(i->get());
  } else if (const auto* f = node.as_floating_point()) {
    std::ostringstream out;
    out.precision(17);
    out << f->get();
    *text = out.str();
  } else if (const auto* b = node.as_boolean()) {
    *text = b->get() ? "true" : "false";
  } else {
    return false;
  }
  return true;
}

}  // namespace

std::vector<std::string> SuggestFlags(const CLI::App& app, const std::string& name) {
  const size_t start = name.find_first_not_of('-');
  const std::string wanted = Hyphenated(start == std::string::npos ? "" : name.substr(start));
  const size_t limit = std::max<size_t>(2, wanted.size() / 3);
  std::vector<std::pair<size_t, std::string>> close;
  for (const CLI::Option* option : app.get_options()) {
    for (const std::string& long_name : option->get_lnames()) {
      if (long_name == "help" || long_name == "version" || long_name == "config") continue;
      const size_t distance = EditDistance(wanted, long_name);
      if (distance <= limit) close.emplace_back(distance, long_name);
    }
  }
  std::sort(close.begin(), close.end());
  std::vector<std::string> names;
  for (const auto& [distance, long_name] : close) {
    if (names.size() == 3) break;
    names.push_back(long_name);
  }
  return names;
}

std::string TomlFlagFile::to_config(const CLI::App* app, bool default_also, bool write_description,
                                    std::string prefix) const {
  return CLI::ConfigTOML().to_config(app, default_also, write_description, std::move(prefix));
}

std::vector<CLI::ConfigItem> TomlFlagFile::from_config(std::istream& input) const {
  const std::string text((std::istreambuf_iterator<char>(input)), std::istreambuf_iterator<char>());
  toml::table table;
  try {
    table = toml::parse(text);
  } catch (const toml::parse_error& error) {
    throw CLI::ConfigError(
        absl::StrCat(At(app_, error.source()), ": not TOML: ", std::string(error.description())));
  }
  std::vector<CLI::ConfigItem> items;
  std::vector<std::string> names;
  for (auto&& [key, node] : table) {
    const std::string name = Hyphenated(std::string(key.str()));
    const std::string where = At(app_, key.source());
    if (std::find(names.begin(), names.end(), name) != names.end()) {
      // "a_b" and "a-b" are one flag: the second would be dropped silently.
      throw CLI::ConfigError(absl::StrCat(where, ": '", std::string(key.str()), "' sets --", name,
                                          ", which an earlier line sets too"));
    }
    names.push_back(name);
    if (node.is_table() || node.is_array_of_tables()) {
      throw CLI::ConfigError(
          absl::StrCat(where, ": [", std::string(key.str()),
                       "] is a table; the file holds flags only (name = value)"));
    }
    const CLI::Option* option = app_->get_option_no_throw("--" + name);
    if (option == nullptr || name == "help" || name == "version" || name == "config") {
      const std::vector<std::string> close = SuggestFlags(*app_, name);
      throw CLI::ConfigError(absl::StrCat(
          where, ": '", std::string(key.str()), "' is not a flag of this server",
          close.empty() ? std::string(" (--help lists them)")
                        : absl::StrCat("; did you mean ", absl::StrJoin(close, " or "), "?")));
    }
    CLI::ConfigItem item;
    item.name = name;
    if (const toml::array* array = node.as_array()) {
      for (const toml::node& element : *array) {
        std::string value;
        if (!ScalarText(element, &value)) {
          throw CLI::ConfigError(absl::StrCat(At(app_, element.source()), ": ",
                                              std::string(key.str()),
                                              ": a list holds strings, numbers or booleans only"));
        }
        item.inputs.push_back(std::move(value));
      }
    } else {
      std::string value;
      if (!ScalarText(node, &value)) {
        throw CLI::ConfigError(absl::StrCat(where, ": ", std::string(key.str()),
                                            ": a date or time is not a flag value; quote it"));
      }
      item.inputs.push_back(std::move(value));
    }
    items.push_back(std::move(item));
  }
  return items;
}

int ParseServerFlags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    const int code = app.exit(error);
    if (dynamic_cast<const CLI::ExtrasError*>(&error) != nullptr) {
      for (const std::string& extra : app.remaining()) {
        if (extra.rfind("--", 0) != 0) continue;
        const std::string name = extra.substr(2, extra.find('=') - 2);
        const std::vector<std::string> close = SuggestFlags(app, name);
        if (!close.empty()) {
          std::fprintf(stderr, "%s: did you mean --%s?\n", extra.c_str(),
                       absl::StrJoin(close, " or --").c_str());
        }
      }
    }
    return code;
  }
  return -1;
}

}  // namespace dsa
