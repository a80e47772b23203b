// Note [Algorithms by measurement] (collective_algorithm.h): the table, its parser and the choice.
#include "dist/collective_algorithm.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "io/read_only_file.h"

namespace fsdp::detail {

// Defined in the file CMake generates from src/dist/collective_algorithms.tsv.
const char* builtin_algorithm_table_data();

namespace {

constexpr const char* kColumns[] = {"operation", "machines", "ranks_per_machine", "max_bytes", "algorithm"};
constexpr int64_t kLargestTableBytes = int64_t{1} << 20;  // a table of a few hundred rows is a few KB

const std::vector<std::pair<std::string, CollectiveOperation>>& operation_names() {
  static const std::vector<std::pair<std::string, CollectiveOperation>> names = {
      {"all_gather", CollectiveOperation::kAllGather},
      {"reduce_scatter", CollectiveOperation::kReduceScatter},
      {"all_reduce", CollectiveOperation::kAllReduce}};
  return names;
}

const std::vector<std::pair<std::string, CollectiveAlgorithm>>& algorithm_names() {
  static const std::vector<std::pair<std::string, CollectiveAlgorithm>> names = {
      {"direct", CollectiveAlgorithm::kDirect},
      {"ring", CollectiveAlgorithm::kRing},
      {"two_level_direct", CollectiveAlgorithm::kTwoLevelDirect},
      {"two_level_ring", CollectiveAlgorithm::kTwoLevelRing}};
  return names;
}

template <class Value>
std::string accepted(const std::vector<std::pair<std::string, Value>>& names) {
  std::string text;
  for (const auto& [name, value] : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> fields;
  std::istringstream stream(line);
  std::string field;
  while (stream >> field) fields.push_back(field);
  return fields;
}

int64_t positive_integer(const std::string& text, const std::string& where, const char* column) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(end != text.c_str() && *end == '\0' && errno == 0 && value > 0, where, ": column '", column,
              "' must be a positive integer, found '", text, "'. Write the table with `collective_bench --sweep`.");
  return value;
}

// The kind of a layout: one machine, one rank per machine, or several of each. A collective takes
// only rows measured on a layout of its own kind (a one-machine row says nothing about a network).
int kind_of(int64_t machines, int64_t ranks_per_machine) {
  return (machines > 1 ? 2 : 0) + (ranks_per_machine > 1 ? 1 : 0);
}

double log_distance(int64_t a, int64_t b) {
  return std::abs(std::log2(static_cast<double>(a)) - std::log2(static_cast<double>(b)));
}

}  // namespace

const char* to_string(CollectiveOperation operation) {
  for (const auto& [name, value] : operation_names()) {
    if (value == operation) return name.c_str();
  }
  return "unknown operation";
}

const char* to_string(CollectiveAlgorithm algorithm) {
  for (const auto& [name, value] : algorithm_names()) {
    if (value == algorithm) return name.c_str();
  }
  return "unknown algorithm";
}

GroupShape group_shape(const std::vector<int64_t>& member_machines) {
  GroupShape shape;
  if (member_machines.empty()) return shape;
  // Machines in the order their first member appears; group rank g must be on the (g / L)-th.
  std::vector<int64_t> order;
  std::map<int64_t, int64_t> members_on;
  for (const auto machine : member_machines) {
    if (members_on[machine]++ == 0) order.push_back(machine);
  }
  shape.machines = static_cast<int64_t>(order.size());
  const auto size = static_cast<int64_t>(member_machines.size());
  if (size % shape.machines != 0) {
    shape.regular = false;
    shape.ranks_per_machine = 1;
    shape.machines = size;
    return shape;
  }
  shape.ranks_per_machine = size / shape.machines;
  for (int64_t index = 0; index < size; ++index) {
    if (member_machines[static_cast<size_t>(index)] != order[static_cast<size_t>(index / shape.ranks_per_machine)]) {
      shape.regular = false;
    }
  }
  if (!shape.regular) {
    // Flat algorithms only; as far as they care, every member is a machine of its own.
    shape.machines = size;
    shape.ranks_per_machine = 1;
  }
  return shape;
}

bool algorithm_applies(CollectiveAlgorithm algorithm, const GroupShape& shape) {
  switch (algorithm) {
    case CollectiveAlgorithm::kDirect:
    case CollectiveAlgorithm::kRing:
      return true;
    case CollectiveAlgorithm::kTwoLevelDirect:
    case CollectiveAlgorithm::kTwoLevelRing:
      return shape.two_level();
  }
  return false;
}

AlgorithmTable parse_algorithm_table(const std::string& text, const std::string& source) {
  AlgorithmTable table;
  table.source = source;
  std::istringstream stream(text);
  std::string line;
  int64_t number = 0;
  bool header_seen = false;
  while (std::getline(stream, line)) {
    ++number;
    const auto where = "collective algorithm table " + source + ", line " + std::to_string(number);
    const auto first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    const auto fields = fields_of(line);
    if (!header_seen) {
      const std::vector<std::string> expected(std::begin(kColumns), std::end(kColumns));
      TORCH_CHECK(fields == expected, where, ": expected the header line 'operation machines ranks_per_machine ",
                  "max_bytes algorithm', found '", line, "'. Write the table with `collective_bench --sweep`.");
      header_seen = true;
      continue;
    }
    TORCH_CHECK(fields.size() == 5, where, ": expected 5 columns (operation, machines, ranks_per_machine, ",
                "max_bytes, algorithm), found ", fields.size(), " in '", line, "'.");
    AlgorithmTableRow row;
    row.line = number;
    const auto operation = std::find_if(operation_names().begin(), operation_names().end(),
                                        [&](const auto& e) { return e.first == fields[0]; });
    TORCH_CHECK(operation != operation_names().end(), where, ": column 'operation' must be one of ",
                accepted(operation_names()), ", found '", fields[0], "'.");
    row.operation = operation->second;
    row.machines = positive_integer(fields[1], where, "machines");
    row.ranks_per_machine = positive_integer(fields[2], where, "ranks_per_machine");
    TORCH_CHECK(row.machines * row.ranks_per_machine >= 2, where, ": a layout of ", row.machines, " x ",
                row.ranks_per_machine, " has one rank, which runs no collective.");
    row.max_bytes = fields[3] == "-" ? -1 : positive_integer(fields[3], where, "max_bytes");
    const auto algorithm = std::find_if(algorithm_names().begin(), algorithm_names().end(),
                                        [&](const auto& e) { return e.first == fields[4]; });
    TORCH_CHECK(algorithm != algorithm_names().end(), where, ": column 'algorithm' must be one of ",
                accepted(algorithm_names()), ", found '", fields[4], "'.");
    row.algorithm = algorithm->second;
    GroupShape shape{row.machines, row.ranks_per_machine, true};
    TORCH_CHECK(algorithm_applies(row.algorithm, shape), where, ": ", fields[4], " needs several machines of several ",
                "ranks each, but the row's layout is ", row.machines, " x ", row.ranks_per_machine, ".");
    for (const auto& other : table.rows) {
      TORCH_CHECK(!(other.operation == row.operation && other.machines == row.machines &&
                    other.ranks_per_machine == row.ranks_per_machine && other.max_bytes == row.max_bytes),
                  where, ": the same operation, layout and max_bytes as line ", other.line,
                  "; each (operation, layout, size) has one row.");
    }
    table.rows.push_back(row);
  }
  TORCH_CHECK(header_seen, "collective algorithm table ", source, ": no header line and no rows. ",
              "Write the table with `collective_bench --sweep`.");
  return table;
}

std::string format_algorithm_table(const std::vector<AlgorithmTableRow>& rows, const std::string& comment) {
  std::ostringstream out;
  std::istringstream lines(comment);
  std::string line;
  while (std::getline(lines, line)) out << "# " << line << "\n";
  out << "operation\tmachines\tranks_per_machine\tmax_bytes\talgorithm\n";
  for (const auto& row : rows) {
    out << to_string(row.operation) << "\t" << row.machines << "\t" << row.ranks_per_machine << "\t"
        << (row.max_bytes < 0 ? std::string("-") : std::to_string(row.max_bytes)) << "\t" << to_string(row.algorithm)
        << "\n";
  }
  return out.str();
}

AlgorithmChoice choose_algorithm(const AlgorithmTable& table, CollectiveOperation operation, const GroupShape& shape,
                                 int64_t bytes) {
  AlgorithmChoice choice;
  choice.algorithm = shape.two_level() ? CollectiveAlgorithm::kTwoLevelDirect : CollectiveAlgorithm::kDirect;
  const int kind = kind_of(shape.machines, shape.ranks_per_machine);
  // The nearest layout of the group's kind: log2 distance in machines first, then in ranks per machine.
  const AlgorithmTableRow* nearest = nullptr;
  auto key = [&](const AlgorithmTableRow& row) {
    return std::make_pair(log_distance(row.machines, shape.machines),
                          log_distance(row.ranks_per_machine, shape.ranks_per_machine));
  };
  for (const auto& row : table.rows) {
    if (row.operation != operation || kind_of(row.machines, row.ranks_per_machine) != kind) continue;
    if (!algorithm_applies(row.algorithm, shape)) continue;
    if (nearest == nullptr || key(row) < key(*nearest)) nearest = &row;
  }
  if (nearest == nullptr) return choice;
  // Among that layout's rows, the smallest max_bytes that holds `bytes`; above all of them, "-" or
  // else the largest.
  const AlgorithmTableRow* best = nullptr;
  auto limit = [](const AlgorithmTableRow& row) {
    return row.max_bytes < 0 ? std::numeric_limits<int64_t>::max() : row.max_bytes;
  };
  const AlgorithmTableRow* largest = nullptr;
  for (const auto& row : table.rows) {
    if (row.operation != operation || row.machines != nearest->machines ||
        row.ranks_per_machine != nearest->ranks_per_machine || !algorithm_applies(row.algorithm, shape)) {
      continue;
    }
    if (largest == nullptr || limit(row) > limit(*largest)) largest = &row;
    if (bytes <= limit(row) && (best == nullptr || limit(row) < limit(*best))) best = &row;
  }
  choice.row = best != nullptr ? best : largest;
  choice.algorithm = choice.row->algorithm;
  return choice;
}

int64_t two_level_pieces(int64_t chunk_elements, int64_t element_bytes) {
  constexpr int64_t kSmallestPiece = int64_t{256} << 10;
  for (const int64_t pieces : {4, 2}) {
    if (chunk_elements % pieces == 0 && chunk_elements / pieces * element_bytes >= kSmallestPiece) return pieces;
  }
  return 1;
}

TrafficPerRank traffic_per_rank(CollectiveOperation operation, CollectiveAlgorithm algorithm, const GroupShape& shape,
                                int64_t group_rank, int64_t buffer_bytes, int64_t element_bytes) {
  const int64_t size = shape.size();
  const int64_t per_machine = shape.ranks_per_machine;
  const int64_t chunk = buffer_bytes / size;
  // An all-reduce is a reduce-scatter then an all-gather of the same chunks: twice the messages and bytes.
  const int64_t halves = operation == CollectiveOperation::kAllReduce ? 2 : 1;
  TrafficPerRank traffic;
  traffic.bytes = halves * (size - 1) * chunk;  // every algorithm sends (N-1)/N of the buffer per half
  switch (algorithm) {
    case CollectiveAlgorithm::kDirect:
      traffic.messages = halves * (size - 1);
      traffic.off_machine_bytes = halves * (size - per_machine) * chunk;
      break;
    case CollectiveAlgorithm::kRing: {
      traffic.messages = halves * (size - 1);
      const bool next_is_away = (group_rank + 1) % size / per_machine != group_rank / per_machine;
      traffic.off_machine_bytes = next_is_away ? traffic.bytes : 0;
      break;
    }
    case CollectiveAlgorithm::kTwoLevelDirect:
    case CollectiveAlgorithm::kTwoLevelRing: {
      // An all-gather moves bytes; the reductions cut their chunk in elements.
      const bool gather = operation == CollectiveOperation::kAllGather;
      const int64_t pieces = algorithm == CollectiveAlgorithm::kTwoLevelRing
                                 ? 1
                                 : two_level_pieces(gather ? chunk : chunk / element_bytes, gather ? 1 : element_bytes);
      traffic.messages = halves * pieces * ((shape.machines - 1) + (per_machine - 1));
      traffic.off_machine_bytes = halves * (shape.machines - 1) * chunk;
      break;
    }
  }
  return traffic;
}

const std::string& builtin_algorithm_table_text() {
  static const std::string text = builtin_algorithm_table_data();
  return text;
}

const AlgorithmTable& engine_algorithm_table() {
  static std::once_flag once;
  static std::unique_ptr<AlgorithmTable> table;
  static std::string failure;
  std::call_once(once, [] {
    const char* path = std::getenv("FSDP_COLLECTIVE_TABLE");
    try {
      if (path != nullptr && *path != '\0') {
        const auto text = read_text_file(path, kLargestTableBytes, "collective algorithm table",
                                         "Write it with `collective_bench --sweep`.");
        table = std::make_unique<AlgorithmTable>(parse_algorithm_table(text, std::string("'") + path + "'"));
      } else {
        table = std::make_unique<AlgorithmTable>(
            parse_algorithm_table(builtin_algorithm_table_text(), "the built-in table"));
      }
    } catch (const c10::Error& error) {
      failure = std::string("FSDP_COLLECTIVE_TABLE: ") + error.what_without_backtrace() +
                " Unset FSDP_COLLECTIVE_TABLE to use the built-in table.";
    }
  });
  TORCH_CHECK(table != nullptr, failure);
  return *table;
}

}  // namespace fsdp::detail
