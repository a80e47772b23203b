// See selftest.h. Every expected value is computed locally from a closed form, never by another
// collective, so a broken collective cannot hide behind itself.
#include "dist/selftest.h"

#include <ATen/ATen.h>
#include <fsdp/collectives.h>

#include <cmath>
#include <functional>
#include <sstream>

#include "dist/c10d/backend.h"

namespace fsdp::detail {
namespace {

const std::vector<at::ScalarType>& selftest_dtypes() {
  static const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                                                     at::kInt,   at::kShort,  at::kChar, at::kByte,     at::kBool};
  return dtypes;
}

// Small integers: exact in every dtype, and sums over a few ranks stay exact in bf16 and int8.
double value(int64_t rank, int64_t index, at::ScalarType dtype) {
  if (dtype == at::kBool) return (rank + index) % 3 == 0 ? 1.0 : 0.0;
  return static_cast<double>((rank * 7 + index * 3) % 11);
}

at::Tensor make_tensor(const std::vector<double>& values, at::ScalarType dtype) {
  auto doubles = at::tensor(values, at::kDouble);
  if (values.empty()) doubles = at::empty({0}, at::kDouble);
  return dtype == at::kBool ? doubles.ne(0) : doubles.to(dtype);
}

double combine(double left, double right, ReduceOp op, at::ScalarType dtype) {
  if (dtype == at::kBool) return op == ReduceOp::kMin ? (left != 0 && right != 0) : (left != 0 || right != 0);
  switch (op) {
    case ReduceOp::kSum:
      return left + right;
    case ReduceOp::kMax:
      return std::max(left, right);
    case ReduceOp::kMin:
      return std::min(left, right);
  }
  return 0;
}

class Checker {
 public:
  explicit Checker(int64_t global_rank) : global_rank_(global_rank) {}

  void expect_equal(const std::string& what, const at::Tensor& actual, const std::vector<double>& expected,
                    double tolerance = 0.0) {
    ++checks_;
    auto values = actual.to(at::kDouble).reshape({-1});
    if (values.numel() != static_cast<int64_t>(expected.size())) {
      fail(what + ": " + std::to_string(values.numel()) + " elements, expected " + std::to_string(expected.size()));
      return;
    }
    auto accessor = values.accessor<double, 1>();
    for (int64_t index = 0; index < values.numel(); ++index) {
      if (std::abs(accessor[index] - expected[index]) > tolerance * std::max(1.0, std::abs(expected[index]))) {
        std::ostringstream text;
        text << what << ": element " << index << " is " << accessor[index] << ", expected " << expected[index];
        fail(text.str());
        return;
      }
    }
  }

  void expect(bool ok, const std::string& what) {
    ++checks_;
    if (!ok) fail(what);
  }

  void run(const std::string& what, const std::function<void()>& body) {
    try {
      body();
    } catch (const std::exception& error) {
      ++checks_;
      fail(what + ": threw " + error.what());
    }
  }

  void fail(const std::string& text) { failures_.push_back("[rank " + std::to_string(global_rank_) + "] " + text); }
  const std::vector<std::string>& failures() const { return failures_; }
  int64_t checks() const { return checks_; }

 private:
  int64_t global_rank_;
  int64_t checks_ = 0;
  std::vector<std::string> failures_;
};

std::string dtype_name(at::ScalarType dtype) { return c10::toString(dtype); }

void check_all_gather(const ProcessGroup& group, at::ScalarType dtype, Checker& checker) {
  const int64_t size = group.size();
  for (int64_t shard_numel : {0, 1, 5}) {
    std::vector<double> mine, expected;
    for (int64_t index = 0; index < shard_numel; ++index) mine.push_back(value(group.rank(), index, dtype));
    for (int64_t rank = 0; rank < size; ++rank) {
      for (int64_t index = 0; index < shard_numel; ++index) expected.push_back(value(rank, index, dtype));
    }
    auto output = make_tensor(std::vector<double>(expected.size(), 0.0), dtype);
    std::string what = "all_gather " + group.name() + " " + dtype_name(dtype) + " shard " + std::to_string(shard_numel);
    checker.run(what, [&] {
      all_gather(group, output, make_tensor(mine, dtype));
      checker.expect_equal(what, output, expected);
    });
  }
}

// A logical tensor of `logical_numel` elements padded to size * ceil(numel / size), as FSDP pads.
void check_reduce_scatter(const ProcessGroup& group, at::ScalarType dtype, Checker& checker) {
  const int64_t size = group.size();
  for (int64_t logical_numel : {int64_t{0}, int64_t{1}, 2 * size + 1}) {
    const int64_t shard_numel = (logical_numel + size - 1) / size;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      std::vector<double> input(size * shard_numel, 0.0), expected;
      for (int64_t index = 0; index < logical_numel; ++index) input[index] = value(group.rank(), index, dtype);
      for (int64_t index = 0; index < shard_numel; ++index) {
        const int64_t global_index = group.rank() * shard_numel + index;
        double reduced = global_index < logical_numel ? value(0, global_index, dtype) : 0.0;
        for (int64_t rank = 1; rank < size; ++rank) {
          reduced = combine(reduced, global_index < logical_numel ? value(rank, global_index, dtype) : 0.0, op, dtype);
        }
        expected.push_back(reduced);
      }
      auto output = make_tensor(std::vector<double>(shard_numel, 0.0), dtype);
      std::string what = std::string("reduce_scatter(") + to_string(op) + ") " + group.name() + " " +
                         dtype_name(dtype) + " numel " + std::to_string(logical_numel);
      checker.run(what, [&] {
        ReduceScatterOptions options;
        options.op = op;
        reduce_scatter(group, output, make_tensor(input, dtype), options);
        checker.expect_equal(what, output, expected);
      });
    }
  }
  if (dtype == at::kFloat || dtype == at::kDouble) {
    // FSDP's averaging: divide by 2 before and by size / 2 after, i.e. a mean over ranks.
    const int64_t shard_numel = 3;
    std::vector<double> input(size * shard_numel), expected(shard_numel, 0.0);
    for (int64_t index = 0; index < size * shard_numel; ++index) input[index] = value(group.rank(), index, dtype);
    for (int64_t index = 0; index < shard_numel; ++index) {
      for (int64_t rank = 0; rank < size; ++rank)
        expected[index] += value(rank, group.rank() * shard_numel + index, dtype);
      expected[index] /= static_cast<double>(size);
    }
    auto output = make_tensor(std::vector<double>(shard_numel, 0.0), dtype);
    std::string what = "reduce_scatter(mean) " + group.name() + " " + dtype_name(dtype);
    checker.run(what, [&] {
      ReduceScatterOptions options;
      options.pre_divide_factor = 2.0;
      options.post_divide_factor = static_cast<double>(size) / 2.0;
      reduce_scatter(group, output, make_tensor(input, dtype), options);
      checker.expect_equal(what, output, expected, 1e-6);
    });
  }
}

void check_all_reduce(const ProcessGroup& group, at::ScalarType dtype, Checker& checker) {
  const int64_t size = group.size();
  for (int64_t numel : {int64_t{0}, int64_t{1}, 2 * size + 1}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      std::vector<double> mine, expected;
      for (int64_t index = 0; index < numel; ++index) {
        mine.push_back(value(group.rank(), index, dtype));
        double reduced = value(0, index, dtype);
        for (int64_t rank = 1; rank < size; ++rank) reduced = combine(reduced, value(rank, index, dtype), op, dtype);
        expected.push_back(reduced);
      }
      auto tensor = make_tensor(mine, dtype);
      std::string what = std::string("all_reduce(") + to_string(op) + ") " + group.name() + " " + dtype_name(dtype) +
                         " numel " + std::to_string(numel);
      checker.run(what, [&] {
        all_reduce(group, tensor, op);
        checker.expect_equal(what, tensor, expected);
      });
    }
  }
}

void check_broadcast(const ProcessGroup& group, at::ScalarType dtype, Checker& checker) {
  const int64_t root = group.size() - 1;
  std::vector<double> mine, expected;
  for (int64_t index = 0; index < 5; ++index) {
    mine.push_back(value(group.rank(), index, dtype));
    expected.push_back(value(root, index, dtype));
  }
  auto tensor = make_tensor(mine, dtype);
  std::string what = "broadcast " + group.name() + " " + dtype_name(dtype) + " from " + std::to_string(root);
  checker.run(what, [&] {
    broadcast(group, tensor, root);
    checker.expect_equal(what, tensor, expected);
  });
}

void check_async(const ProcessGroup& group, Checker& checker) {
  checker.run("async all_gather + reduce_scatter " + group.name(), [&] {
    const int64_t size = group.size();
    auto gathered = at::empty({size * 4}, at::kFloat);
    auto shard = at::full({4}, static_cast<double>(group.rank() + 1), at::kFloat);
    auto reduced = at::empty({2}, at::kFloat);
    auto input = at::ones({size * 2}, at::kFloat);
    auto first = all_gather_async(group, gathered, shard);
    auto second = reduce_scatter_async(group, reduced, input);
    first.wait();
    second.wait();
    std::vector<double> expected_gather, expected_reduce(2, static_cast<double>(size));
    for (int64_t rank = 0; rank < size; ++rank) expected_gather.insert(expected_gather.end(), 4, rank + 1.0);
    checker.expect_equal("async all_gather " + group.name(), gathered, expected_gather);
    checker.expect_equal("async reduce_scatter " + group.name(), reduced, expected_reduce);
  });
}

// Byte counters must equal (N-1)/N of the full buffer for all-gather and reduce-scatter, 2(N-1)/N for
// all-reduce, whatever the algorithm; the bytes that leave the machine and the messages must be the
// algorithm's (Note [Algorithms by measurement]).
void check_bytes(const ProcessGroup& group, Checker& checker, std::vector<std::string>& lines) {
  const int64_t size = group.size();
  const int64_t shard_numel = 1000;
  const int64_t buffer_bytes = size * shard_numel * static_cast<int64_t>(sizeof(float));
  auto& state = state_of(group);
  const auto shape = state.members->shape;
  auto measure = [&](CollectiveOperation operation, const std::function<void()>& run, auto counter, int64_t numerator) {
    const char* name = to_string(operation);
    checker.run(std::string("bytes ") + name, [&] {
      const auto algorithm = algorithm_for(state, operation, buffer_bytes);
      group.reset_bytes_sent();
      run();
      const auto sent = group.bytes_sent();
      const int64_t measured = counter(sent);
      const int64_t theory = numerator * (size - 1) * buffer_bytes / size;
      const auto expected = traffic_per_rank(operation, algorithm, shape, group.rank(), buffer_bytes, 4);
      std::ostringstream line;
      line << "  " << name << " on '" << group.name() << "' (" << to_string(algorithm) << "): sent " << measured
           << " bytes of a " << buffer_bytes << "-byte buffer; theory " << (numerator == 1 ? "" : "2")
           << "(N-1)/N x buffer = " << theory << (measured == theory ? "  ok" : "  MISMATCH") << "; off the machine "
           << sent.off_machine << " (theory " << expected.off_machine_bytes << "), " << sent.messages
           << " messages (theory " << expected.messages << ")";
      const bool layout_ok =
          !shape.regular || (sent.off_machine == expected.off_machine_bytes && sent.messages == expected.messages);
      lines.push_back(line.str() + (layout_ok ? "" : "  MISMATCH"));
      checker.expect(measured == theory && layout_ok, line.str());
    });
  };
  auto full = at::zeros({size * shard_numel}, at::kFloat);
  auto shard = at::zeros({shard_numel}, at::kFloat);
  measure(
      CollectiveOperation::kAllGather, [&] { all_gather(group, full, shard); },
      [](const CollectiveByteCounters& counters) { return counters.all_gather; }, 1);
  measure(
      CollectiveOperation::kReduceScatter, [&] { reduce_scatter(group, shard, full); },
      [](const CollectiveByteCounters& counters) { return counters.reduce_scatter; }, 1);
  measure(
      CollectiveOperation::kAllReduce, [&] { all_reduce(group, full); },
      [](const CollectiveByteCounters& counters) { return counters.all_reduce; }, 2);
  group.reset_bytes_sent();
}

}  // namespace

SelftestReport run_collective_selftest(const DistributedContext& context) {
  Checker checker(context.rank());
  SelftestReport report;
  std::vector<const ProcessGroup*> groups = {&context.world()};
  if (context.intra_node().size() != context.world().size()) groups.push_back(&context.intra_node());
  if (context.cross_node().size() > 1) groups.push_back(&context.cross_node());

  for (const ProcessGroup* group : groups) {
    for (at::ScalarType dtype : selftest_dtypes()) {
      check_all_gather(*group, dtype, checker);
      check_reduce_scatter(*group, dtype, checker);
      check_all_reduce(*group, dtype, checker);
      check_broadcast(*group, dtype, checker);
    }
    check_async(*group, checker);
    checker.run("barrier " + group->name(), [&] { barrier(*group); });
  }
  report.lines.push_back("bytes sent per rank (N = " + std::to_string(context.world_size()) + "):");
  check_bytes(context.world(), checker, report.lines);

  // Every rank learns whether any rank failed, so all exit with the same verdict.
  auto failed_ranks = at::tensor({checker.failures().empty() ? int64_t{0} : int64_t{1}}, at::kLong);
  all_reduce(context.control(), failed_ranks);
  const int64_t failing = failed_ranks.item<int64_t>();
  report.failures = checker.failures();
  report.passed = failing == 0;
  std::ostringstream summary;
  summary << "selftest: " << checker.checks() << " checks per rank over " << groups.size() << " group(s) and "
          << selftest_dtypes().size() << " dtypes on " << context.world_size()
          << " rank(s): " << (report.passed ? "PASSED" : "FAILED on " + std::to_string(failing) + " rank(s)");
  report.lines.push_back(summary.str());
  return report;
}

}  // namespace fsdp::detail
