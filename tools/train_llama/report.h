// Private to train_llama: what a run leaves for people to read — metrics.jsonl, a loss-curve SVG,
// a progress line on a terminal.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace train_llama {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  double peak_rss_mb = 0;
  std::optional<double> eval_loss;
};

/// metrics.jsonl: one JSON object per optimizer step. Opening it for a resumed run keeps only the
/// lines up to the step the run resumes from, so the file tells one story.
class MetricsLog {
 public:
  MetricsLog(const std::string& path, int64_t resumed_step);
  void append(const StepMetrics& metrics);
  const std::vector<StepMetrics>& all() const { return metrics_; }

 private:
  std::string path_;
  std::vector<StepMetrics> metrics_;
};

/// An SVG picture of training loss (and eval loss where measured) against step.
void write_loss_curve(const std::string& path, const std::vector<StepMetrics>& metrics);

/// The resident-memory high-water mark of this process, in MB.
double peak_rss_mb();

/// "step 120/400  loss 2.345  12.3k tok/s  ETA 20 s" redrawn in place on a terminal.
void print_progress(int64_t step, int64_t steps, double loss, double tokens_per_s, double seconds_left);

}  // namespace train_llama
