// Private to train_llama: the two jobs it runs, training (with checkpoints that resume exactly and
// a Hugging Face directory at the end) and evaluating a Hugging Face directory.
#pragma once

#include <fsdp/process_group.h>

#include "train_llama/settings.h"

namespace train_llama {

/// --eval-only: prints eval_loss=<float> for --init-from on --data. Returns the exit code.
int evaluate_only(const Settings& settings, const fsdp::DistributedContext& context);

/// Trains as `settings` say, resuming where they or a restart say. Returns the exit code.
int train(const Settings& settings, const fsdp::DistributedContext& context);

}  // namespace train_llama
