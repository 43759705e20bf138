// Text -> token ids for the examples: lowercase words and single punctuation marks, a vocabulary
// of every token in the text (most frequent first), and the way back to text for printing.
// Nothing here knows about xent.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace examples {

/// Reads every file named by `paths`; a directory contributes its regular files (not symlinks,
/// which on Debian duplicate licenses: GPL -> GPL-3), in name order. Throws std::runtime_error
/// naming the path when something cannot be read.
inline std::string read_corpus(const std::vector<std::string>& paths,
                               std::vector<std::string>* files_read = nullptr) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      const std::size_t first = files.size();
      for (const fs::directory_entry& e : fs::directory_iterator(p, ec)) {
        std::error_code entry_ec;
        if (e.is_regular_file(entry_ec) && !e.is_symlink(entry_ec)) files.push_back(e.path());
      }
      if (ec) throw std::runtime_error("cannot list '" + p + "': " + ec.message());
      std::sort(files.begin() + static_cast<std::ptrdiff_t>(first), files.end());
    } else {
      files.emplace_back(p);
    }
  }
  std::string text;
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      std::error_code ec;
      const std::string why = fs::exists(f, ec) ? "not readable" : "no such file or directory";
      throw std::runtime_error("cannot read corpus '" + f.string() + "': " + why);
    }
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    text.push_back('\n');
    if (files_read) files_read->push_back(f.string());
  }
  return text;
}

/// Splits text into tokens: runs of letters and digits (lowercased, an inner apostrophe kept, as
/// in "program's"; bytes >= 0x80 count as letters so UTF-8 words stay whole) and every other
/// non-space character on its own ("(", ",", ".").
inline std::vector<std::string> tokenize(const std::string& text) {
  auto is_word = [](unsigned char c) { return std::isalnum(c) || c >= 0x80; };
  std::vector<std::string> tokens;
  std::string word;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const bool inner_apostrophe = c == '\'' && !word.empty() && i + 1 < text.size() &&
                                  std::isalpha(static_cast<unsigned char>(text[i + 1]));
    if (is_word(c) || inner_apostrophe) {
      word.push_back(static_cast<char>(std::tolower(c)));
      continue;
    }
    if (!word.empty()) tokens.push_back(std::move(word)), word.clear();
    if (!std::isspace(c)) tokens.emplace_back(1, static_cast<char>(c));
  }
  if (!word.empty()) tokens.push_back(std::move(word));
  return tokens;
}

/// Every distinct token, most frequent first (ties in byte order, so ids are reproducible).
class vocabulary {
 public:
  explicit vocabulary(const std::vector<std::string>& tokens) {
    std::unordered_map<std::string, std::int64_t> counts;
    for (const std::string& t : tokens) ++counts[t];
    std::vector<std::pair<std::string, std::int64_t>> sorted(counts.begin(), counts.end());
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
      return a.second != b.second ? a.second > b.second : a.first < b.first;
    });
    for (auto& [word, count] : sorted) {
      ids_.emplace(word, static_cast<std::int32_t>(words_.size()));
      words_.push_back(word);
      counts_.push_back(count);
    }
  }

  std::int64_t size() const { return static_cast<std::int64_t>(words_.size()); }
  const std::string& word(std::int32_t id) const { return words_[static_cast<std::size_t>(id)]; }
  std::int64_t count(std::int32_t id) const { return counts_[static_cast<std::size_t>(id)]; }
  /// The id of `word`, or -1 when the text never had it.
  std::int32_t id(const std::string& word) const {
    const auto it = ids_.find(word);
    return it == ids_.end() ? -1 : it->second;
  }

  std::vector<std::int32_t> encode(const std::vector<std::string>& tokens) const {
    std::vector<std::int32_t> out;
    out.reserve(tokens.size());
    for (const std::string& t : tokens) out.push_back(id(t));
    return out;
  }

  /// Tokens back to readable text: words separated by spaces, none before closing punctuation or
  /// after an opening bracket, none around "-" and "/", and double quotes paired up.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    auto is = [](const std::string& w, const char* set) {
      return w.size() == 1 && std::string(set).find(w[0]) != std::string::npos;
    };
    std::string out;
    bool glue_next = true, in_quote = false;
    for (const std::int32_t i : ids) {
      const std::string& w = word(i);
      const bool quote = w == "\"";
      const bool glue_before = is(w, ",.;:!?)]}-/") || (quote && in_quote);
      if (!glue_next && !glue_before) out.push_back(' ');
      out += w;
      glue_next = is(w, "([{-/") || (quote && !in_quote);
      if (quote) in_quote = !in_quote;
    }
    return out;
  }

 private:
  std::vector<std::string> words_;
  std::vector<std::int64_t> counts_;
  std::unordered_map<std::string, std::int32_t> ids_;
};

}  // namespace examples
