#include "client/dosctl/table.h"

#include <algorithm>
#include <iomanip>

namespace dos::dosctl {

Table::Table(std::vector<std::string> headers, std::vector<bool> right_aligned)
    : headers_(std::move(headers)), right_(std::move(right_aligned)) {
  right_.resize(headers_.size(), false);
}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(headers_.size());
  rows_.push_back(std::move(cells));
}

void Table::Print(std::ostream& out) const {
  std::vector<size_t> width(headers_.size());
  for (size_t c = 0; c < headers_.size(); ++c) {
    width[c] = headers_[c].size();
    for (const auto& r : rows_) width[c] = std::max(width[c], r[c].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) out << "  ";
      const bool last = c + 1 == cells.size();
      if (right_[c]) {
        out << std::setw(static_cast<int>(width[c])) << std::right << cells[c];
      } else if (last) {
        out << cells[c];
      } else {
        out << std::setw(static_cast<int>(width[c])) << std::left << cells[c];
      }
    }
    out << '\n';
  };
  line(headers_);
  for (const auto& r : rows_) line(r);
}

}  // namespace dos::dosctl
