// Table: a plain-text table with aligned columns for dosctl's readable output.
//
// Columns are left-aligned unless their header is added to the right-aligned
// set (numbers). Thread-safety: none; a value type.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace dos::dosctl {

class Table {
 public:
  explicit Table(std::vector<std::string> headers, std::vector<bool> right_aligned = {});
  void AddRow(std::vector<std::string> cells);
  void Print(std::ostream& out) const;

 private:
  std::vector<std::string> headers_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace dos::dosctl
