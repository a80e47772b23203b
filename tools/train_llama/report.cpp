#include "train_llama/report.h"

#include <c10/util/Exception.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace train_llama {

namespace {

/// One metrics.jsonl line.
std::string metrics_line(const StepMetrics& metrics) {
  nlohmann::json value = {{"step", metrics.step},
                          {"loss", metrics.loss},
                          {"lr", metrics.lr},
                          {"grad_norm", metrics.grad_norm},
                          {"tokens_per_s", metrics.tokens_per_s},
                          {"peak_rss_mb", metrics.peak_rss_mb}};
  if (metrics.eval_loss) value["eval_loss"] = *metrics.eval_loss;
  return value.dump();
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, int64_t resumed_step) : path_(path) {
  std::ifstream existing(path);
  std::string line;
  while (resumed_step > 0 && std::getline(existing, line)) {
    try {
      const auto value = nlohmann::json::parse(line);
      StepMetrics metrics;
      metrics.step = value.at("step").get<int64_t>();
      if (metrics.step > resumed_step) break;
      metrics.loss = value.at("loss").get<double>();
      metrics.lr = value.at("lr").get<double>();
      metrics.grad_norm = value.value("grad_norm", 0.0);
      metrics.tokens_per_s = value.value("tokens_per_s", 0.0);
      metrics.peak_rss_mb = value.value("peak_rss_mb", 0.0);
      if (value.contains("eval_loss")) metrics.eval_loss = value["eval_loss"].get<double>();
      metrics_.push_back(metrics);
    } catch (const nlohmann::json::exception&) {
      break;  // a torn last line of a killed run
    }
  }
  std::ofstream rewrite(path, std::ios::trunc);
  TORCH_CHECK(rewrite, "cannot write '", path, "': ", std::strerror(errno), "; check --output-dir");
  for (const auto& metrics : metrics_) rewrite << metrics_line(metrics) << "\n";
}

void MetricsLog::append(const StepMetrics& metrics) {
  metrics_.push_back(metrics);
  std::ofstream file(path_, std::ios::app);
  file << metrics_line(metrics) << "\n";
}

void write_loss_curve(const std::string& path, const std::vector<StepMetrics>& metrics) {
  if (metrics.empty()) return;
  const double width = 720, height = 420, left = 60, right = 20, top = 30, bottom = 50;
  double max_step = 1, low = 1e30, high = -1e30;
  for (const auto& point : metrics) {
    max_step = std::max(max_step, static_cast<double>(point.step));
    low = std::min(low, point.loss);
    high = std::max(high, point.loss);
    if (point.eval_loss) {
      low = std::min(low, *point.eval_loss);
      high = std::max(high, *point.eval_loss);
    }
  }
  if (high - low < 1e-9) high = low + 1;
  auto x = [&](double step) { return left + (width - left - right) * step / max_step; };
  auto y = [&](double loss) { return top + (height - top - bottom) * (high - loss) / (high - low); };
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='" << height << "'>\n"
      << "<rect width='100%' height='100%' fill='white'/>\n"
      << "<text x='" << width / 2 << "' y='20' text-anchor='middle' font-family='sans-serif' font-size='14'>"
      << "train_llama: loss per step</text>\n"
      << "<line x1='" << left << "' y1='" << height - bottom << "' x2='" << width - right << "' y2='" << height - bottom
      << "' stroke='black'/>\n<line x1='" << left << "' y1='" << top << "' x2='" << left << "' y2='" << height - bottom
      << "' stroke='black'/>\n";
  for (int tick = 0; tick <= 4; ++tick) {
    const double loss = low + (high - low) * tick / 4.0, step = max_step * tick / 4.0;
    svg << "<text x='" << left - 6 << "' y='" << y(loss) + 4 << "' text-anchor='end' font-family='sans-serif' "
        << "font-size='11'>" << std::fixed;
    svg.precision(2);
    svg << loss << "</text>\n<text x='" << x(step) << "' y='" << height - bottom + 16
        << "' text-anchor='middle' font-family='sans-serif' font-size='11'>";
    svg.precision(0);
    svg << step << "</text>\n";
  }
  svg.precision(3);
  svg << "<polyline fill='none' stroke='steelblue' stroke-width='1.5' points='";
  for (const auto& point : metrics) svg << x(point.step) << "," << y(point.loss) << " ";
  svg << "'/>\n";
  for (const auto& point : metrics) {
    if (point.eval_loss) {
      svg << "<circle cx='" << x(point.step) << "' cy='" << y(*point.eval_loss) << "' r='4' fill='darkorange'/>\n";
    }
  }
  svg << "<text x='" << width - right << "' y='" << top + 14 << "' text-anchor='end' font-family='sans-serif' "
      << "font-size='12'><tspan fill='steelblue'>train loss</tspan>  <tspan fill='darkorange'>eval "
         "loss</tspan></text>\n"
      << "<text x='" << width / 2 << "' y='" << height - 12 << "' text-anchor='middle' font-family='sans-serif' "
      << "font-size='12'>optimizer step</text>\n</svg>\n";
  std::ofstream(path) << svg.str();
}

double peak_rss_mb() {
  struct rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

void print_progress(int64_t step, int64_t steps, double loss, double tokens_per_s, double seconds_left) {
  if (!::isatty(STDERR_FILENO)) return;
  std::fprintf(stderr, "\rstep %lld/%lld  loss %.4f  %.1fk tok/s  ETA %.0f s     ", static_cast<long long>(step),
               static_cast<long long>(steps), loss, tokens_per_s / 1000.0, seconds_left);
  if (step == steps) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

}  // namespace train_llama
